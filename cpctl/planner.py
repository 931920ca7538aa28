"""How much GPU memory one training step takes, and how long a sequence fits: `cpctl plan`.

Pure arithmetic over a Llama-shaped decoder (no torch): each term of the memory is one
function below, in bytes per GPU, at each of the moments of a step where the peak can fall:

* `loss`: the end of the forward, while the loss is differentiated. With full logits this is
  nearly always the peak: every block's checkpoint is alive and so are the logits, their fp32
  log-softmax and two fp32 gradients of that size.
* `mlp_backward` / `attention_backward`: the first block's backward (the last layer), after
  its recompute: all checkpoints are still alive, plus the block's own working set, at its
  largest either in the MLP's backward or in attention's (where CP gathers K/V).
* `last_block_backward`: attention's backward in the last block of the backward (the first
  layer): the checkpoints are gone but the fp32 sharded gradients of every other block are
  there. The peak falls here when checkpoints do not hold GPU memory (offload_activations)
  or when the gradients outweigh them (few tokens, few shards).
* `optimizer_step`: sharded fp32 parameters, gradients and AdamW state, and the fp32
  temporary AdamW's foreach step makes.

The model is what `scripts/train_llama.py` and the README's loop do: FSDP2 over dp_shard x cp
(tensor parallelism splits the blocks), mixed precision (a block's parameters gathered in
bf16 while it runs, the root's embeddings and head gathered for the whole step), activation
checkpointing per block, AdamW, `optimizer.zero_grad(set_to_none=True)`, and the loss as
`F.cross_entropy(logits.float(), ...)` with `logits` held by the loop until backward ends
(or `model(labels=...).loss`, which holds them not), or a chunked loss (`rt.causal_lm_loss`).
Calibration (tests/test_planner.py, docs/cli.md): the sum of the terms matches
torch.cuda.max_memory_allocated of 26 measured H200 runs, with and without the memory options,
within 2% (one within 5%).
What torch's peak does not count is added last: a fixed CUDA/NCCL overhead and the
allocator's headroom (memory it holds in blocks it cannot reuse).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpctl.errors import CpctlError

GiB = 2**30
FP32 = 4  # bytes
MOMENTS = ("loss", "mlp_backward", "attention_backward", "last_block_backward", "optimizer_step")
BLOCK_MOMENTS = ("mlp_backward", "attention_backward", "last_block_backward")
GPU_COUNTS = (1, 2, 4, 8, 16, 32)  # the rows of "longest sequence that fits"
MAX_GPUS = 4096  # how far "GPUs needed" searches
MAX_TOKENS = 2**40

DEFAULT_GPU_MEMORY_GIB = 141.0  # an H200
# Memory torch's peak does not count. Calibrated on one H200 (torch sees 139.8 GiB): peaks of
# 125.9 GiB (scripts/llama.py 1b at 224k tokens) and 127.9 GiB (Llama-3.2-3B shape at 48k)
# trained; 129.0 GiB (Llama-3.2-1B shape at 64k) and 135.8 GiB (1b at 512k on 2 GPUs) ran out
# of memory. A fixed overhead (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers) plus a
# share of the peak for the caching allocator's fragments puts that edge at 128.5 GiB.
CUDA_OVERHEAD_GIB = 2.5
ALLOCATOR_HEADROOM = 0.078  # share of the peak


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, rotary GQA attention, SwiGLU MLP, untied or tied head."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int
    tied_embeddings: bool = False
    notes: tuple[str, ...] = ()

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        attention = self.dim * self.q_dim + 2 * self.dim * self.kv_dim + self.q_dim * self.dim
        return attention + 3 * self.dim * self.ffn_dim + 2 * self.dim  # + the two norms

    @property
    def root_params(self) -> int:
        """Embeddings, head (unless tied) and the final norm: FSDP's root module."""
        return self.vocab_size * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    @property
    def params(self) -> int:
        return self.n_layers * self.block_params + self.root_params

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "notes": list(self.notes), "params": self.params}


def _llama(name: str, *, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(name, vocab, dim, layers, heads, kv_heads, ffn, dim // heads, tied)


# scripts/llama.py's presets (tests/test_planner.py checks they agree) and the Llama 3 shapes.
PRESETS: dict[str, ModelShape] = {
    "tiny": _llama("tiny", vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "1b": _llama("1b", vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-1b": _llama("llama-3.2-1b", vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.2-3b": _llama("llama-3.2-3b", vocab=128256, dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.1-8b": _llama("llama-3.1-8b", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}

_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def load_model(spec: str) -> ModelShape:
    """A preset name, or a Hugging Face config.json (or the directory holding one)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists() and ("/" in spec or spec.endswith(".json")):
        raise CpctlError(f"--model {spec}: no such file (a Hugging Face config.json, or the directory holding one)")
    if not path.exists():
        close = difflib.get_close_matches(spec, PRESETS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise CpctlError(f"--model {spec}: no such preset or file{hint} (presets: {', '.join(PRESETS)}; "
                         "or a Hugging Face config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CpctlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CpctlError(f"{path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise CpctlError(f"{path}: not a Hugging Face config.json (a JSON object was expected)")
    return model_from_hf_config(config, name=str(path))


def model_from_hf_config(config: Mapping[str, Any], *, name: str) -> ModelShape:
    text = config.get("text_config")
    if "hidden_size" not in config and isinstance(text, Mapping):  # a multimodal model's language part
        config = text
    missing = [key for key in _HF_REQUIRED if key not in config]
    if missing:
        raise CpctlError(f"{name}: no {missing[0]} in it; cpctl plan reads a decoder LM's config.json "
                         f"({', '.join(_HF_REQUIRED)})")

    def positive(key: str, default: Any = None) -> int:
        value = config.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CpctlError(f"{name}: {key} must be a positive integer, got {value!r}")
        return value

    heads = positive("num_attention_heads")
    dim = positive("hidden_size")
    notes = []
    if any(key in config for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        notes.append("a mixture of experts: counted as one dense MLP of intermediate_size, experts not counted")
    if config.get("model_type") not in (None, "llama"):
        notes.append(f"model_type {config.get('model_type')}: estimated as a Llama block of its sizes")
    return ModelShape(
        name=str(config.get("_name_or_path") or name), vocab_size=positive("vocab_size"), dim=dim,
        n_layers=positive("num_hidden_layers"), n_heads=heads,
        n_kv_heads=positive("num_key_value_heads", heads),
        ffn_dim=positive("intermediate_size"), head_dim=positive("head_dim", dim // heads),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), notes=tuple(notes),
    )


# ----------------------------------------------------------------------------- lengths

_LENGTH = re.compile(r"(\d+(?:\.\d+)?)([kKmM]?)")


def parse_tokens(text: str, *, what: str = "--seq-len") -> int:
    """4096, 128k (x 1024), 1M or 1.5M (x 1024**2)."""
    match = _LENGTH.fullmatch(str(text).strip().replace("_", "").replace(",", ""))
    if match is None:
        raise CpctlError(f"{what} {text}: not a length; write tokens as e.g. 4096, 128k or 1M")
    number, suffix = match.groups()
    scale = {"": 1, "k": 1024, "m": 1024**2}[suffix.lower()]
    tokens = float(number) * scale
    if tokens != int(tokens) or tokens < 1:
        raise CpctlError(f"{what} {text}: must be a whole number of tokens, at least 1")
    return int(tokens)


def format_tokens(tokens: int) -> str:
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return f"{tokens:,}"


def parse_number(text: str, *, what: str, integer: bool = False, minimum: float = 1) -> float:
    try:
        value = int(text) if integer else float(text)
    except (TypeError, ValueError):
        raise CpctlError(f"{what} {text}: not {'an integer' if integer else 'a number'}") from None
    if not value >= minimum or math.isinf(value):
        raise CpctlError(f"{what} {text}: must be at least {minimum:g}")
    return value


# ----------------------------------------------------------------------------- the setup


@dataclass(frozen=True)
class Setup:
    """What a plan is for: the layout and the memory options of a resolved profile."""

    gpus: int = 1
    cp: int = 1
    dp_shard: int = 1
    tp: int = 1
    strategy: str = "allgather"
    precision: str = "bf16"  # bf16 | fp16 | no
    activation_checkpointing: bool = True
    checkpoint_level: str = "full"  # selective: attention's saved tensors are kept, not recomputed
    reshard_after_forward: bool = True
    chunked_loss: bool = False
    loss_chunk_tokens: int = 4096
    tiled_mlp_tokens: int = 0
    offload_activations: bool = False
    cpu_offload: bool = False
    batch: int = 1  # sequences per CP group in one step
    logits_kept: bool = True  # the loop holds the logits until backward ends (not with model(labels=...).loss)
    first_step: bool = False  # AdamW's state does not exist until the first optimizer step

    @classmethod
    def from_profile(cls, profile: Any, *, chunked_loss: bool = False, batch: int = 1) -> Setup:
        memory = profile.memory
        return cls(
            gpus=profile.world_size, cp=profile.parallelism.cp_size, dp_shard=profile.parallelism.dp_shard_size,
            tp=profile.parallelism.tp_size, strategy=profile.parallelism.cp_comm_strategy,
            precision=profile.fsdp.mixed_precision, activation_checkpointing=profile.fsdp.activation_checkpointing,
            reshard_after_forward=profile.fsdp.reshard_after_forward, chunked_loss=chunked_loss,
            checkpoint_level=getattr(memory, "checkpoint_level", "full"),
            loss_chunk_tokens=memory.loss_chunk_tokens, tiled_mlp_tokens=getattr(memory, "tiled_mlp_tokens", 0),
            offload_activations=getattr(memory, "offload_activations", False),
            cpu_offload=getattr(memory, "cpu_offload", False), batch=batch,
        )

    def with_cp(self, gpus: int) -> Setup:
        """All `gpus` on CP: one FSDP shard per CP rank, no TP or replicas."""
        return dataclasses.replace(self, gpus=gpus, cp=gpus, dp_shard=1, tp=1)

    def describe(self) -> str:
        options = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}: cp {self.cp} x dp_shard {self.dp_shard}"
                   + (f" x tp {self.tp}" if self.tp > 1 else "")
                   + (f" x dp_replicate {self.gpus // (self.cp * self.dp_shard * self.tp)}"
                      if self.gpus > self.cp * self.dp_shard * self.tp else ""),
                   self.strategy if self.cp > 1 else "no CP",
                   {"no": "fp32"}.get(self.precision, self.precision),
                   f"activation checkpointing {'off' if not self.activation_checkpointing else 'on' if self.checkpoint_level == 'full' else self.checkpoint_level}",
                   f"loss chunked ({self.loss_chunk_tokens} tokens)" if self.chunked_loss else "full logits in the loss"]
        if not self.reshard_after_forward:
            options.append("blocks stay gathered after forward")
        if self.tiled_mlp_tokens:
            options.append(f"MLP in tiles of {self.tiled_mlp_tokens} tokens")
        if self.offload_activations:
            options.append("activations offloaded")
        if self.cpu_offload:
            options.append("parameters and optimizer on CPU")
        return ", ".join(options)


MEMORY_OPTIONS = ("checkpoint_level", "tiled_mlp_tokens", "offload_activations", "cpu_offload")  # read where the profile has them


def available_options() -> frozenset[str]:
    """The memory options of the profile schema beyond loss chunking that this cpctl knows."""
    from cpctl.config import KEYS

    return frozenset(name for name in MEMORY_OPTIONS if f"memory.{name}" in KEYS)


@dataclass(frozen=True)
class Resolved:
    setup: Setup
    target: str  # the machine the profile was resolved for, in words
    note: str | None  # what --gpus changed


def resolve_setup(*, flags: Mapping[str, str], config: str | Path | None = None, profile_name: str | None = None,
                  gpus: int | None = None, chunked_loss: bool = False, logits_kept: bool = True, batch: int = 1,
                  environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Resolved:
    """The profile `cpctl check --static` would validate (a cuda profile as on its own node, so a
    GPU plan works on a laptop); `device: auto` is taken as cuda. `--gpus N` makes the world N
    GPUs, all of them CP unless --cp-size is given (dp_replicate and tp as the profile says)."""
    from cpctl.config import AUTO, merge_layers, preview

    values, _, _ = merge_layers(flags=flags, config=config, profile_name=profile_name, environ=environ, cwd=cwd)
    device = values.get("launch.device", AUTO)
    if device == "cpu":
        raise CpctlError("the profile runs on cpu; cpctl plan estimates GPU memory: pass --device cuda")
    extra = {"launch.device": "cuda"} if device == AUTO else {}
    note = None
    if gpus is not None:
        nnodes = values.get("launch.nnodes", 1)
        if gpus % nnodes:
            raise CpctlError(f"--gpus {gpus} is not a multiple of nnodes {nnodes}")
        extra["launch.nproc_per_node"] = str(gpus // nnodes)
        if "parallelism.cp_size" not in flags:
            others = values.get("parallelism.tp_size", 1) * values.get("parallelism.dp_replicate_size", 1)
            if gpus % others:
                raise CpctlError(f"--gpus {gpus} is not a multiple of tp x dp_replicate = {others}")
            extra["parallelism.cp_size"] = str(gpus // others)
            note = f"--gpus {gpus}: cp {gpus // others}"
        if "parallelism.dp_shard_size" not in flags:
            extra["parallelism.dp_shard_size"] = AUTO
    shown = preview(flags={**flags, **extra}, config=config, profile_name=profile_name, environ=environ, cwd=cwd)
    setup = dataclasses.replace(Setup.from_profile(shown.resolved.profile, chunked_loss=chunked_loss, batch=batch),
                                logits_kept=logits_kept)
    return Resolved(setup, shown.target, note)


# ----------------------------------------------------------------------------- the terms


@dataclass(frozen=True)
class Sizes:
    """The numbers every term needs: tokens on this GPU, shards, element sizes."""

    model: ModelShape
    setup: Setup
    seq_len: int

    @property
    def local_tokens(self) -> int:  # L: this GPU's share of its CP group's tokens
        return self.setup.batch * self.seq_len // self.setup.cp

    @property
    def group_tokens(self) -> int:  # S: the tokens of the sequences one CP group holds
        return self.setup.batch * self.seq_len

    @property
    def act(self) -> int:  # bytes of an activation (and of a gathered parameter)
        return FP32 if self.setup.precision == "no" else 2

    @property
    def dtype(self) -> str:
        return "fp32" if self.act == FP32 else "bf16"

    @property
    def shards(self) -> int:  # FSDP shards the fp32 parameters, gradients and optimizer state over dp_shard x cp
        return self.setup.dp_shard * self.setup.cp

    @property
    def params_per_gpu(self) -> float:  # TP splits the blocks; FSDP shards everything
        model = self.model
        return (model.n_layers * model.block_params / self.setup.tp + model.root_params) / self.shards

    @property
    def block_params_per_gpu(self) -> float:  # one block, gathered
        return self.model.block_params / self.setup.tp


@dataclass(frozen=True)
class Term:
    name: str
    at: dict[str, float]  # bytes at each moment
    how: str


def _at(loss: float = 0, mlp: float | None = None, attention: float | None = None, step: float | None = None,
        last: float | None = None) -> dict[str, float]:
    """Bytes at the moments; each backward moment defaults to the one before it, the step to 0."""
    mlp = loss if mlp is None else mlp
    attention = mlp if attention is None else attention
    return {"loss": loss, "mlp_backward": mlp, "attention_backward": attention,
            "last_block_backward": attention if last is None else last, "optimizer_step": 0 if step is None else step}


def parameters(z: Sizes) -> Term:
    """fp32 master weights, sharded by FSDP."""
    if z.setup.cpu_offload:
        return Term("parameters", _at(0), "fp32, on CPU (cpu_offload)")
    held = FP32 * z.params_per_gpu
    return Term("parameters", _at(held, step=held), f"fp32, sharded over {z.shards} (dp_shard x cp)")


def gathered_parameters(z: Sizes) -> Term:
    """Mixed-precision copies FSDP all-gathers: the root (embeddings, head) for the whole step,
    a block while it runs and the next one prefetched; all blocks if they are not resharded."""
    model, root = z.model, z.act * z.model.root_params
    block = z.act * z.block_params_per_gpu
    if not z.setup.reshard_after_forward:
        every = model.n_layers * block
        return Term("parameters, gathered", _at(root + every), f"{z.dtype} embeddings + head + every block")
    return Term("parameters, gathered", _at(root, mlp=root + 2 * block),
                f"{z.dtype} embeddings + head; 2 blocks in backward")


def gradients(z: Sizes) -> Term:
    """None at the loss (zero_grad(set_to_none=True)); in a block's backward the head's gradient
    (kept gathered until backward ends), the block's own and its fp32 reduce-scatter input,
    and in the last block the fp32 sharded gradients of all the others; all of them at the step."""
    head = z.act * z.model.vocab_size * z.model.dim
    block = z.act * z.block_params_per_gpu + (FP32 * z.block_params_per_gpu if z.act != FP32 else 0)
    done = 0 if z.setup.cpu_offload else (z.model.n_layers - 1) * FP32 * z.block_params_per_gpu / z.shards
    sharded = 0 if z.setup.cpu_offload else FP32 * z.params_per_gpu
    return Term("gradients", _at(0, mlp=head + block, last=head + block + done, step=sharded),
                "head's + a block's in backward, + the other blocks' fp32 shards at the last; all at the step")


def optimizer_state(z: Sizes) -> Term:
    """AdamW: two fp32 states per parameter, sharded; its foreach step adds one more fp32 temporary."""
    if z.setup.cpu_offload:
        return Term("optimizer state", _at(0), "AdamW, on CPU (cpu_offload)")
    state = 2 * FP32 * z.params_per_gpu
    return Term("optimizer state", _at(0 if z.setup.first_step else state, step=state + FP32 * z.params_per_gpu),
                "AdamW, 2 fp32 states; +1 temporary at the step")


def _norm_saved(z: Sizes) -> float:
    """Per token, what an RMSNorm keeps for backward: its fp32 input, the normalized value, its output."""
    return FP32 * z.model.dim + 2 * z.act * z.model.dim


def attention_saved_per_token(z: Sizes) -> float:
    """Per token, what the attention half of a block keeps for backward: its norm, q/k/v after
    rotary, the output, and the fp32 log-sum-exp per head (TP splits the heads)."""
    model, tp = z.model, z.setup.tp
    return _norm_saved(z) + z.act * (2 * model.q_dim + 2 * model.kv_dim) / tp + FP32 * model.n_heads / tp


def mlp_saved_per_token(z: Sizes) -> float:
    """Per token, what the MLP half keeps: its norm and gate, up, silu(gate), silu(gate) * up."""
    return _norm_saved(z) + 4 * z.act * z.model.ffn_dim / z.setup.tp * _mlp_tile_share(z)


def selective_kept_per_token(z: Sizes) -> float:
    """Per token, what the selective level keeps of a block beyond its input: attention's saved
    tensors (q, k, v, out, log-sum-exp); its norm is recomputed."""
    selective = z.setup.activation_checkpointing and z.setup.checkpoint_level == "selective"
    return attention_saved_per_token(z) - _norm_saved(z) if selective else 0.0


def block_saved_per_token(z: Sizes) -> float:
    return attention_saved_per_token(z) + mlp_saved_per_token(z)


def _mlp_tile_share(z: Sizes) -> float:
    """The share of the local tokens whose MLP intermediates exist at once (tiled MLP: one tile)."""
    tile = z.setup.tiled_mlp_tokens
    return min(tile, z.local_tokens) / z.local_tokens if tile and z.local_tokens else 1.0


def activations(z: Sizes) -> Term:
    """With checkpointing: each block's input (the residual stream), bf16; the final norm's and
    head's inputs until the loss's backward. Without: every block's saved activations."""
    model, tokens = z.model, z.local_tokens
    if z.setup.activation_checkpointing:
        per_layer = z.act * model.dim + selective_kept_per_token(z)
    else:
        per_layer = block_saved_per_token(z)
    layers_held = min(model.n_layers, 2) if z.setup.offload_activations else model.n_layers
    blocks = layers_held * per_layer * tokens
    last_block = per_layer * tokens  # the first layer's own, all that is left
    head_inputs = 0 if z.setup.offload_activations else _norm_saved(z) * tokens
    if z.setup.activation_checkpointing:
        how = f"{model.n_layers} block inputs, {z.dtype}; the head's inputs"
        if z.setup.checkpoint_level == "selective":
            how = f"{model.n_layers} block inputs and attention's q, k, v, out (selective); the head's inputs"
    else:
        how = f"all {model.n_layers} blocks' activations (no checkpointing)"
    if z.setup.offload_activations:
        how = f"in pinned CPU memory (offload_activations); {layers_held} layers' worth back at a time"
    return Term("activations for backward", _at(blocks + head_inputs, mlp=blocks, last=last_block), how)


def attention_working_set(z: Sizes) -> Term:
    """In the first block's backward: its recomputed attention tensors (with checkpointing);
    in attention's own backward also dout, dq, dk, dv, an fp32 dq accumulator and the residual
    gradient, plus the K/V that CP moves: the whole sequence's K/V and a gradient buffer of
    that size (allgather), or two K/V blocks and their gradients in flight (alltoall)."""
    model, tp, tokens = z.model, z.setup.tp, z.local_tokens
    # The selective level recomputes the norm only: attention's own tensors are in `activations`.
    recomputed = (attention_saved_per_token(z) - selective_kept_per_token(z)) * tokens if z.setup.activation_checkpointing else 0
    grads = (z.act * (2 * model.q_dim + 2 * model.kv_dim) / tp + FP32 * model.q_dim / tp + z.act * model.dim) * tokens
    # then the block's input norm differentiates in fp32: about 4 tensors of model width
    norm_backward = 4 * FP32 * model.dim * tokens
    kv_per_token = 2 * z.act * model.kv_dim / tp  # K and V
    if z.setup.cp == 1:
        moved, how = 0, "q, k, v, out, their gradients"
    elif z.setup.strategy == "allgather":
        moved = 2 * kv_per_token * z.group_tokens
        how = "q, k, v, out, gradients; the whole sequence's K/V + its gradient"
    else:
        moved = 4 * kv_per_token * tokens
        how = "q, k, v, out, gradients; 2 K/V blocks + 2 gradient blocks"
    return Term("attention working set", _at(0, mlp=recomputed, attention=recomputed + grads + moved + norm_backward),
                how + "; the norm's fp32 backward")


def mlp_working_set(z: Sizes) -> Term:
    """In the MLP's backward: its recomputed tensors (with checkpointing), two more of
    intermediate size (the gradients of silu(gate) and up beside that of the product), and
    the gradient of the block's output. Freed before attention's backward."""
    model, tokens = z.model, z.local_tokens
    recomputed = mlp_saved_per_token(z) * tokens if z.setup.activation_checkpointing else 0
    transient = (2 * z.act * model.ffn_dim / z.setup.tp * _mlp_tile_share(z) + z.act * model.dim) * tokens
    tiles = f", tiles of {z.setup.tiled_mlp_tokens} tokens" if z.setup.tiled_mlp_tokens else ""
    return Term("MLP working set", _at(0, mlp=recomputed + transient, attention=0),
                f"{'6' if z.setup.activation_checkpointing else '2'} tensors of intermediate size{tiles}")


def loss(z: Sizes) -> Term:
    """Full logits: the logits (bf16, held by the loop until backward ends), their fp32
    log-softmax, its gradient and the fp32 logits' gradient: local tokens x vocab x (2+4+4+4).
    Chunked: the same for one chunk, plus the head's fp32 gradient and the hidden states' gradient."""
    model, tokens = z.model, z.local_tokens
    if not z.setup.chunked_loss:
        logits = z.act * model.vocab_size * tokens
        if not z.setup.logits_kept:  # model(labels=...).loss: the output, logits and all, is dropped
            return Term("loss", _at(3 * FP32 * model.vocab_size * tokens, mlp=0), "logits x (4+4+4) B")
        at_loss = logits + 3 * FP32 * model.vocab_size * tokens
        return Term("loss", _at(at_loss, mlp=logits),
                    f"logits x ({z.act}+4+4+4) B; the {z.dtype} logits stay until backward ends")
    chunk = min(z.setup.loss_chunk_tokens, tokens)
    at_loss = 4 * FP32 * model.vocab_size * chunk + FP32 * model.vocab_size * model.dim + z.act * model.dim * tokens
    return Term("loss", _at(at_loss, mlp=0),
                f"chunks of {chunk} tokens x vocab x 16 B; head's fp32 gradient")


def _pinned_block(size: float) -> float:
    """PyTorch's pinned host allocator rounds each block up to a power of two."""
    return float(2 ** math.ceil(math.log2(size))) if size > 0 else 0.0


def host_memory(z: Sizes) -> float:
    """Pinned host memory: each offloaded block's saved tensors (the block input, and what the
    selective level keeps), and with cpu_offload the sharded parameters, gradients and AdamW state."""
    host = 0.0
    if z.setup.offload_activations and z.setup.activation_checkpointing:
        per_layer = z.act * z.model.dim + selective_kept_per_token(z)
        host += z.model.n_layers * _pinned_block(per_layer * z.local_tokens)
    if z.setup.cpu_offload:
        host += 4 * FP32 * z.params_per_gpu
    return host


TERMS: tuple[Callable[[Sizes], Term], ...] = (
    parameters, gathered_parameters, gradients, optimizer_state, activations, attention_working_set,
    mlp_working_set, loss,
)


# ----------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Estimate:
    model: ModelShape
    setup: Setup
    seq_len: int
    gpu_memory_gib: float
    terms: tuple[Term, ...]

    def total(self, moment: str) -> float:
        return sum(term.at[moment] for term in self.terms)

    @property
    def peak_moment(self) -> str:
        return max(MOMENTS, key=self.total)

    @property
    def block_moment(self) -> str:
        """The larger of the two moments of a block's backward."""
        return max(BLOCK_MOMENTS, key=self.total)

    @property
    def peak(self) -> float:
        """Bytes: what torch.cuda.max_memory_allocated would report."""
        return self.total(self.peak_moment)

    @property
    def headroom(self) -> float:
        return ALLOCATOR_HEADROOM * self.peak

    @property
    def overhead(self) -> float:
        return CUDA_OVERHEAD_GIB * GiB

    @property
    def needed(self) -> float:
        return self.peak + self.headroom + self.overhead

    @property
    def fits(self) -> bool:
        return self.needed <= self.gpu_memory_gib * GiB

    @property
    def local_tokens(self) -> int:
        return Sizes(self.model, self.setup, self.seq_len).local_tokens

    @property
    def host_bytes(self) -> float:
        """Pinned host memory per GPU that the offload options take (0 without them)."""
        return host_memory(Sizes(self.model, self.setup, self.seq_len))

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len, "local_tokens": self.local_tokens, "setup": dataclasses.asdict(self.setup),
            "terms": [{"name": term.name, "how": term.how, "gib": {m: round(term.at[m] / GiB, 3) for m in MOMENTS}}
                      for term in self.terms],
            "total_gib": {m: round(self.total(m) / GiB, 3) for m in MOMENTS},
            "peak_moment": self.peak_moment, "peak_gib": round(self.peak / GiB, 3),
            "allocator_headroom_gib": round(self.headroom / GiB, 3), "cuda_overhead_gib": CUDA_OVERHEAD_GIB,
            "needed_gib": round(self.needed / GiB, 3), "gpu_memory_gib": self.gpu_memory_gib, "fits": self.fits,
            "host_gib": round(self.host_bytes / GiB, 3),
        }


def estimate(model: ModelShape, setup: Setup, seq_len: int, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB) -> Estimate:
    """The memory per GPU of one training step of `model` on `seq_len`-token sequences."""
    if seq_len < 1:
        raise CpctlError(f"sequence length must be at least 1 token, got {seq_len}")
    sizes = Sizes(model, setup, seq_len)
    return Estimate(model, setup, seq_len, gpu_memory_gib, tuple(term(sizes) for term in TERMS))


def peak_gib(model: ModelShape, setup: Setup, seq_len: int) -> float:
    return estimate(model, setup, seq_len).peak / GiB


def longest_fitting(model: ModelShape, setup: Setup, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB) -> int:
    """The longest sequence (a multiple of 1024 and of 2 x cp) that fits; 0 if none does."""
    unit = math.lcm(1024, 2 * setup.cp)

    def fits(units: int) -> bool:
        return estimate(model, setup, units * unit, gpu_memory_gib=gpu_memory_gib).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
        if high * unit > MAX_TOKENS:
            return low * unit
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * unit


def gpus_needed(model: ModelShape, setup: Setup, seq_len: int, *,
                gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB) -> Estimate | None:
    """The smallest power-of-two GPU count (all on CP) on which `seq_len` fits, or None."""
    gpus = 1
    while gpus <= MAX_GPUS:
        if seq_len * setup.batch >= gpus:
            found = estimate(model, setup.with_cp(gpus), seq_len, gpu_memory_gib=gpu_memory_gib)
            if found.fits:
                return found
        gpus *= 2
    return None


# ----------------------------------------------------------------------------- advice


@dataclass(frozen=True)
class Suggestion:
    what: str  # the option, as the user turns it on
    changes: dict[str, Any]  # Setup fields
    estimate: Estimate

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "changes": self.changes, "needed_gib": round(self.estimate.needed / GiB, 3),
                "fits": self.estimate.fits}


def _options_to_try(setup: Setup, *, available: frozenset[str]) -> list[tuple[str, dict[str, Any], bool]]:
    """Memory options that are off in `setup`: (flag, Setup changes, slow), those that cost
    little speed first."""
    options: list[tuple[str, dict[str, Any], bool]] = []
    if not setup.activation_checkpointing:
        options.append(("--activation-checkpointing true", {"activation_checkpointing": True}, False))
    if not setup.chunked_loss:
        options.append(("a chunked loss: rt.causal_lm_loss (--chunked-loss here)", {"chunked_loss": True}, False))
    if not setup.reshard_after_forward:
        options.append(("--reshard-after-forward true", {"reshard_after_forward": True}, False))
    if setup.cp > 1 and setup.strategy == "allgather":
        options.append(("--cp-comm-strategy alltoall", {"strategy": "alltoall"}, False))
    if "checkpoint_level" in available and setup.activation_checkpointing and setup.checkpoint_level != "full":
        options.append(("--checkpoint-level full (slower)", {"checkpoint_level": "full"}, True))
    if "tiled_mlp_tokens" in available and not setup.tiled_mlp_tokens:
        options.append(("--tiled-mlp-tokens 8192", {"tiled_mlp_tokens": 8192}, False))
    if "offload_activations" in available and not setup.offload_activations:
        options.append(("--offload-activations true (slower)", {"offload_activations": True}, True))
    if "cpu_offload" in available and not setup.cpu_offload:
        options.append(("--cpu-offload true (slower)", {"cpu_offload": True}, True))
    return options


def suggestions(base: Estimate, *, available: frozenset[str] = frozenset()) -> list[Suggestion]:
    """What to turn on: each option that lowers the need alone; those that cost little speed
    together; with the slow ones too if that is not enough; then the fewest GPUs, all on CP,
    with the current options and with the cheap ones."""
    model, setup, seq, memory = base.model, base.setup, base.seq_len, base.gpu_memory_gib

    def trying(changes: dict[str, Any]) -> Estimate:
        return estimate(model, dataclasses.replace(setup, **changes), seq, gpu_memory_gib=memory)

    found: list[Suggestion] = []
    cheap: dict[str, Any] = {}
    slow: dict[str, Any] = {}
    for what, changes, is_slow in _options_to_try(setup, available=available):
        alone = trying(changes)
        if alone.needed < base.needed - 0.05 * GiB:
            found.append(Suggestion(what, changes, alone))
            (slow if is_slow else cheap).update(changes)
    together = None
    if len(cheap) > 1:
        together = trying(cheap)
        found.append(Suggestion("together: " + ", ".join(option_names(cheap)), cheap, together))
    if slow and (cheap or len(slow) > 1) and not (together or trying(cheap)).fits:
        everything = {**cheap, **slow}
        found.append(Suggestion("together: " + ", ".join(option_names(everything)), everything, trying(everything)))
    for label, options in [("", {})] + ([(" + " + ", ".join(option_names(cheap)), cheap)] if cheap else []):
        wider = gpus_needed(model, dataclasses.replace(setup, **options), seq, gpu_memory_gib=memory)
        if wider is not None and (wider.setup.gpus, wider.setup.cp) != (setup.gpus, setup.cp):
            gpus = wider.setup.gpus
            found.append(Suggestion(f"{gpus} GPU{'s' if gpus > 1 else ''}, all on CP (--cp-size {gpus}){label}",
                                    {**options, "gpus": gpus, "cp": gpus, "dp_shard": 1, "tp": 1}, wider))
    return found


def option_names(changes: Mapping[str, Any]) -> list[str]:
    names = {"activation_checkpointing": "checkpointing", "chunked_loss": "chunked loss",
             "reshard_after_forward": "resharding", "strategy": "alltoall", "tiled_mlp_tokens": "tiled MLP",
             "offload_activations": "activation offload", "cpu_offload": "CPU offload"}
    return [names.get(name, name) for name in changes]


@dataclass(frozen=True)
class Plan:
    """Everything `cpctl plan` prints."""

    model: ModelShape
    estimate: Estimate
    suggestions: list[Suggestion]
    longest: list[tuple[int, int, int | None]]  # (GPUs, longest with these options, longest with all options or None)
    needed: Estimate | None  # the fewest GPUs (all CP) for the sequence, with these options
    needed_all: Estimate | None  # ... with all_options on
    all_options: dict[str, Any]  # the free memory options that are off: checkpointing, chunked loss, resharding

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "estimate": self.estimate.to_dict(),
            "suggestions": [s.to_dict() for s in self.suggestions],
            "longest": [{"gpus": g, "cp": g, "seq_len": n, "seq_len_all_options": a} for g, n, a in self.longest],
            "gpus_needed": None if self.needed is None else self.needed.setup.gpus,
            "gpus_needed_all_options": None if self.needed_all is None else self.needed_all.setup.gpus,
            "all_options": self.all_options,
            "calibration": {"cuda_overhead_gib": CUDA_OVERHEAD_GIB, "allocator_headroom": ALLOCATOR_HEADROOM},
        }


def all_free_options(setup: Setup) -> dict[str, Any]:
    """The memory options that cost little speed: checkpointing, a chunked loss, resharding."""
    return {name: True for name in ("activation_checkpointing", "chunked_loss", "reshard_after_forward")
            if not getattr(setup, name)}


def make_plan(model: ModelShape, setup: Setup, seq_len: int, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
              available: frozenset[str] = frozenset()) -> Plan:
    base = estimate(model, setup, seq_len, gpu_memory_gib=gpu_memory_gib)
    free = all_free_options(setup)
    better = dataclasses.replace(setup, **free)
    longest = [(gpus, longest_fitting(model, setup.with_cp(gpus), gpu_memory_gib=gpu_memory_gib),
                longest_fitting(model, better.with_cp(gpus), gpu_memory_gib=gpu_memory_gib) if free else None)
               for gpus in GPU_COUNTS]
    return Plan(
        model=model, estimate=base,
        suggestions=[] if base.fits else suggestions(base, available=available),
        longest=longest, needed=gpus_needed(model, setup, seq_len, gpu_memory_gib=gpu_memory_gib),
        needed_all=gpus_needed(model, better, seq_len, gpu_memory_gib=gpu_memory_gib) if free else None,
        all_options=free,
    )
