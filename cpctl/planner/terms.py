"""The terms of the memory per GPU: one function each, in bytes at each moment of a step where the
peak can fall (the package's docstring says which moments, and what the terms model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cpctl.planner.setup import Setup
from cpctl.planner.shapes import ModelShape
from cpctl.planner.units import DTYPE_BYTES
from cpctl.topology import kv_copies

FP32 = DTYPE_BYTES["fp32"]
DROPOUT_MASK = 1  # bytes per element of dropout's saved mask (bool)
INDEX = 8  # bytes of an int64 index
MOMENTS = ("loss", "mlp_backward", "attention_backward", "last_block_backward", "optimizer_step")
BLOCK_MOMENTS = ("mlp_backward", "attention_backward", "last_block_backward")


@dataclass(frozen=True)
class Sizes:
    """The numbers every term needs: tokens on this GPU, shards, element sizes."""

    model: ModelShape
    setup: Setup
    seq_len: int

    @property
    def padded_seq_len(self) -> int:
        """The sequence as the runtime shards it: padded at its end to a multiple of the layout's chunks."""
        chunks = self.setup.sequence_chunks
        return -(-self.seq_len // chunks) * chunks

    @property
    def local_tokens(self) -> int:  # L: this GPU's share of its CP group's tokens (cp x sp ranks)
        return self.setup.batch * self.padded_seq_len // self.setup.seq_ranks

    @property
    def group_tokens(self) -> int:  # S: the tokens of the sequences one CP group holds
        return self.setup.batch * self.padded_seq_len

    @property
    def master(self) -> int:
        """Bytes of a trained weight, of its sharded gradient and of each AdamW state: fp32 (the
        runtime upcasts low-precision weights), or the model's own bf16/fp16 with master_weights keep.
        LoRA's adapters are fp32 either way: peft's get_peft_model makes them so (autocast_adapter_dtype)."""
        kept = self.setup.master_weights == "keep" and self.model.weights_dtype in ("bf16", "fp16")
        return DTYPE_BYTES[self.model.weights_dtype] if kept and self.setup.lora is None else FP32

    @property
    def master_dtype(self) -> str:
        return self.model.weights_dtype if self.master != FP32 else "fp32"

    @property
    def base_dtype(self) -> str:
        """The frozen base's dtype under LoRA (the runtime keeps frozen weights as they arrive): --base-dtype,
        else the model's own (config.json's, what from_pretrained loads), else fp32 (what from_config builds)."""
        chosen = self.setup.lora.base_dtype if self.setup.lora is not None else None
        return chosen or self.model.weights_dtype or "fp32"

    @property
    def act(self) -> int:  # bytes of an activation (and of a gathered parameter); under mixed_precision no, the weights'
        weights = DTYPE_BYTES[self.base_dtype] if self.setup.lora is not None else self.master
        return FP32 if self.setup.precision == "no" and weights == FP32 else 2

    @property
    def dtype(self) -> str:
        return "fp32" if self.act == FP32 else "bf16"

    @property
    def shards(self) -> int:  # FSDP shards the master parameters, gradients and optimizer state over dp_shard x cp x sp
        return self.setup.dp_shard * self.setup.seq_ranks

    @property
    def kv_copies(self) -> int:  # Ulysses repeats K/V heads until sp ranks can split them
        if self.setup.sp == 1:
            return 1
        tp = self.setup.tp
        return kv_copies(q_heads=max(1, self.model.n_heads // tp), kv_heads=max(1, self.model.n_kv_heads // tp),
                         sp=self.setup.sp)

    @property
    def params_per_gpu(self) -> float:  # TP splits the blocks; FSDP shards everything
        model = self.model
        return (model.layers_params / self.setup.tp + model.root_params) / self.shards

    @property
    def block_params_per_gpu(self) -> float:  # one block, gathered (with its adapters)
        return (self.model.block_params + self.block_adapter_params) / self.setup.tp

    @property
    def block_adapter_params(self) -> int:  # LoRA's adapters in one block (0: full fine-tuning)
        return 0 if self.setup.lora is None else self.setup.lora.params_per_layer(self.model)

    @property
    def adapter_params(self) -> int:  # LoRA's adapters in the model: what peft's get_peft_model makes trainable
        return self.model.n_layers * self.block_adapter_params

    @property
    def trained_params_per_gpu(self) -> float:  # what has gradients and AdamW state: LoRA's adapters, else everything
        return self.params_per_gpu if self.setup.lora is None else self.adapter_params / self.setup.tp / self.shards

    @property
    def trained_block_params_per_gpu(self) -> float:  # one block's, gathered
        return (self.model.block_params if self.setup.lora is None else self.block_adapter_params) / self.setup.tp

    @property
    def other_blocks_trained_params_per_gpu(self) -> float:  # every block's but the largest one's, sharded
        model = self.model
        others = (model.layers_params - model.block_params if self.setup.lora is None
                  else (model.n_layers - 1) * self.block_adapter_params)
        return others / self.setup.tp / self.shards

    @property
    def frozen_params_per_gpu(self) -> float:  # LoRA's base: its weights alone, in base_dtype (no gradient, no state)
        return 0.0 if self.setup.lora is None else self.params_per_gpu


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
    """Master weights (fp32 unless kept in the model's dtype), sharded by FSDP. Under LoRA the frozen
    base in its own dtype and the fp32 adapters, both sharded."""
    what = z.master_dtype
    if z.setup.lora is not None:
        what = (f"frozen base {z.base_dtype} ({z.model.params / 1e9:.2f}B) + fp32 adapters "
                f"({z.adapter_params / 1e6:.1f}M)")
    if z.setup.cpu_offload:
        return Term("parameters", _at(0), f"{what}, on CPU (cpu_offload)")
    held = DTYPE_BYTES[z.base_dtype] * z.frozen_params_per_gpu + z.master * z.trained_params_per_gpu
    return Term("parameters", _at(held, step=held), f"{what}, sharded over {z.shards} (dp_shard x cp)")


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
    (kept gathered until backward ends), the block's own and its fp32 reduce-scatter input (under
    mixed precision), and in the last block the sharded gradients (the master weights' dtype) of
    all the others; all of them at the step. Under LoRA only the adapters have gradients."""
    head = 0 if z.setup.lora is not None else z.act * z.model.vocab_size * z.model.dim  # a frozen head has none
    trained = z.trained_block_params_per_gpu
    block = z.act * trained + (FP32 * trained if z.setup.precision != "no" else 0)
    done = 0 if z.setup.cpu_offload else z.master * z.other_blocks_trained_params_per_gpu
    sharded = 0 if z.setup.cpu_offload else z.master * z.trained_params_per_gpu
    how = f"head's + a block's in backward, + the other blocks' {z.master_dtype} shards at the last; all at the step"
    if z.setup.lora is not None:
        how = "the adapters' only (the base is frozen): " + how.removeprefix("head's + ")
    return Term("gradients", _at(0, mlp=head + block, last=head + block + done, step=sharded), how)


def optimizer_state(z: Sizes) -> Term:
    """AdamW: two states per parameter in the master weights' dtype, sharded; its foreach step adds
    one more temporary."""
    if z.setup.cpu_offload:
        return Term("optimizer state", _at(0), "AdamW, on CPU (cpu_offload)")
    state = 2 * z.master * z.trained_params_per_gpu
    temporary = z.master * z.trained_params_per_gpu
    return Term("optimizer state", _at(0 if z.setup.first_step else state, step=state + temporary),
                f"AdamW, 2 {z.master_dtype} states{' of the adapters' if z.setup.lora is not None else ''}; "
                "+1 temporary at the step")


def _norm_saved(z: Sizes) -> float:
    """Per token, what an RMSNorm keeps for backward: its fp32 input, the normalized value, its output."""
    return FP32 * z.model.dim + 2 * z.act * z.model.dim


def _block_norm_saved(z: Sizes) -> float:
    """Per token, what a block's norm keeps: in tiles (tiled_norm_tokens) only its output, the
    rest exists for one tile at a time."""
    return z.act * z.model.dim if z.setup.tiled_norm_tokens else _norm_saved(z)


def attention_saved_per_token(z: Sizes) -> float:
    """Per token, what the attention half of a block keeps for backward: its norms (the input's; Gemma's
    also the output's), the q/k norms' (Qwen3, Gemma 3), q/k/v after rotary, the output, and the fp32
    log-sum-exp per head (TP splits the heads), and its adapters'."""
    return (_attention_norms(z) * _block_norm_saved(z) + qk_norm_saved_per_token(z) + attention_kernel_saved_per_token(z)
            + lora_saved_per_token(z, z.model.attention_projections))


def _attention_norms(z: Sizes) -> int:
    """The block's norms in its attention half: the input's, and with 4 norms a block the output's."""
    return z.model.block_norms // 2


def qk_norm_saved_per_token(z: Sizes) -> float:
    """Per token, what the q and k norms keep: each head's fp32 input and its normalized value (their output
    goes into rotary, which keeps only cos and sin)."""
    model = z.model
    if not model.qk_norm:
        return 0.0
    return ((FP32 + z.act) * (model.q_dim + model.kv_dim) + FP32 * (model.n_heads + model.n_kv_heads)) / z.setup.tp


def attention_kernel_saved_per_token(z: Sizes) -> float:
    """Per token, what attention itself keeps: q/k/v after rotary, the output, the fp32 log-sum-exp."""
    model, tp = z.model, z.setup.tp
    return z.act * (2 * model.q_dim + 2 * model.kv_dim) / tp + FP32 * model.n_heads / tp + ulysses_saved_per_token(z)


def lora_saved_per_token(z: Sizes, projections: dict[str, tuple[int, int]]) -> float:
    """Per token, what LoRA's adapters on these projections keep for backward beyond the block's own:
    lora_B keeps x @ A (rank values); lora_A keeps x, the projection's own input, counted with the block
    (as in full fine-tuning). With lora_dropout > 0, lora_A keeps the dropped-out copy of x instead, and
    dropout its bool mask. The adapters compute in the activations' dtype (FSDP's mixed precision
    gathers them in it)."""
    lora = z.setup.lora
    if lora is None:
        return 0.0
    adapted = lora.targeted(projections)
    dropout = sum((z.act + DROPOUT_MASK) * projections[name][0] for name in adapted) if lora.dropout else 0
    return z.act * lora.rank * len(adapted) + dropout


def ulysses_saved_per_token(z: Sizes) -> float:
    """Per local token, what Ulysses keeps beyond the ring: its engine saves q, k, v, out and the
    log-sum-exp in the head layout (the cp rank's whole sequence for 1/sp of the heads: the bytes of
    L tokens of every head) in place of the token layout's, which the all-to-all does not keep; only
    K/V repeated for fewer heads than sp ranks take more."""
    if z.setup.sp == 1:
        return 0.0
    return z.act * 2 * z.model.kv_dim * (z.kv_copies - 1) / z.setup.tp


def ulysses_exchange_per_token(z: Sizes) -> float:
    """Per local token, Ulysses' buffers when its backward sends the gradients back to the token layout:
    the head-layout dq, dk, dv and the all-to-all's send and receive buffers of them (the token-layout
    gradients are laid out in the spent send buffer), and dout's: its head layout and its all-to-all's
    two buffers, which the communication library may free only later (tests/workers/ulysses_memory.py
    measures q + 3 qkv, or this, 3 q + 3 qkv, on CPU)."""
    if z.setup.sp == 1:
        return 0.0
    model, tp = z.model, z.setup.tp
    return 3 * z.act * model.q_dim / tp + 3 * _head_layout_qkv(z)


def _head_layout_qkv(z: Sizes) -> float:
    """Per local token, q, k and v (or their gradients) in Ulysses' head layout: K/V repeated for fewer
    heads than sp ranks."""
    model = z.model
    return z.act * (model.q_dim + 2 * model.kv_dim * z.kv_copies) / z.setup.tp


def mlp_saved_per_token(z: Sizes) -> float:
    """Per token, what the MLP half keeps: its norms (Gemma's output norm too), gate, up, silu(gate),
    silu(gate) * up (of each of its experts), and its adapters'."""
    mlp = _mlp_intermediates_per_token(z) + lora_saved_per_token(z, z.model.mlp_projections)
    norms = z.model.block_norms - _attention_norms(z)
    return norms * _block_norm_saved(z) + mlp * _tile_share(z, z.setup.tiled_mlp_tokens)


def _mlp_intermediates_per_token(z: Sizes) -> float:
    """Per token, the MLP's own saved tensors: gate, up, act(gate), act(gate) * up of intermediate size.
    A mixture of experts keeps them for each of the token's top-k experts, with the token's copy each
    expert's grouped matmul reads and its output before the routing weight scales it (transformers 5's
    grouped_mm experts), and the router's fp32 probabilities, its top-k indices and weights."""
    model = z.model
    if not model.experts:
        return 4 * z.act * model.ffn_dim / z.setup.tp
    per_expert = 4 * z.act * model.expert_ffn_dim / z.setup.tp + 2 * z.act * model.dim
    routing = FP32 * model.experts + model.experts_per_token * 2 * (INDEX + FP32)
    return model.experts_per_token * per_expert + routing


def selective_kept_per_token(z: Sizes) -> float:
    """Per token, what one block at the selective level keeps beyond its input: attention's saved
    tensors (q, k, v, out, log-sum-exp); its norm and projections (adapters too) are recomputed."""
    return attention_kernel_saved_per_token(z)


def selective_layers(z: Sizes) -> int:
    """How many blocks keep attention's tensors: all at the selective level; under mixed the last
    `selective_blocks` (the first ones backward reaches), the others fully recomputed."""
    setup = z.setup
    if not setup.activation_checkpointing:
        return 0
    if setup.checkpoint_level == "selective":
        return z.model.n_layers
    if setup.checkpoint_level == "mixed":
        return min(setup.selective_blocks or 0, z.model.n_layers)
    return 0


def block_saved_per_token(z: Sizes) -> float:
    return attention_saved_per_token(z) + mlp_saved_per_token(z)


def _tile_share(z: Sizes, tile: int) -> float:
    """The share of the local tokens whose intermediates exist at once in a layer run in tiles of `tile` (0: whole)."""
    return min(tile, z.local_tokens) / z.local_tokens if tile and z.local_tokens else 1.0


def activations(z: Sizes) -> Term:
    """With checkpointing: each block's input (the residual stream), bf16, and what the selective
    blocks keep of attention; the final norm's and head's inputs until the loss's backward.
    Without: every block's saved activations."""
    model, tokens = z.model, z.local_tokens
    kept, selective = selective_kept_per_token(z), selective_layers(z)
    if z.setup.activation_checkpointing:
        held = min(model.n_layers, 2) if z.setup.offload_activations else model.n_layers
        # backward reaches the selective blocks (the last ones) first
        blocks = (held * z.act * model.dim + min(held, selective) * kept) * tokens
        last_block = (z.act * model.dim + (kept if selective == model.n_layers else 0)) * tokens
    else:
        per_layer = block_saved_per_token(z)
        blocks, last_block = model.n_layers * per_layer * tokens, per_layer * tokens
    head_inputs = 0 if z.setup.offload_activations else _norm_saved(z) * tokens
    if z.setup.activation_checkpointing:
        how = f"{model.n_layers} block inputs, {z.dtype}; the head's inputs"
        if selective == model.n_layers:
            how = f"{model.n_layers} block inputs and attention's q, k, v, out (selective); the head's inputs"
        elif selective:
            how = (f"{model.n_layers} block inputs, attention's q, k, v, out in the last {selective} (selective, "
                   f"the other {model.n_layers - selective} full); the head's inputs")
    else:
        how = f"all {model.n_layers} blocks' activations (no checkpointing)"
    if z.setup.offload_activations:
        how = f"in host memory (offload_activations); {min(model.n_layers, 2)} layers' worth back at a time"
    return Term("activations for backward", _at(blocks + head_inputs, mlp=blocks, last=last_block), how)


def attention_working_set(z: Sizes) -> Term:
    """In the first block's backward: its recomputed attention tensors (with checkpointing);
    in attention's own backward also dout, dq, dk, dv, an fp32 dq accumulator and the residual
    gradient, plus the K/V that CP moves: the whole sequence's K/V and a gradient buffer of
    that size (allgather), or two K/V blocks and their gradients in flight (alltoall: the ring rotation)."""
    model, tp, tokens = z.model, z.setup.tp, z.local_tokens
    # The selective level recomputes the norm only: attention's own tensors are in `activations`.
    # (the first block backward reaches, the last layer, is a selective one if any is)
    kept = selective_kept_per_token(z) if selective_layers(z) else 0
    recomputed = (attention_saved_per_token(z) - kept) * tokens if z.setup.activation_checkpointing else 0
    # In the kernel's backward: dout, dq, dk, dv, the kernel's fp32 dq accumulator, the residual's gradient.
    grads = (z.act * (2 * model.q_dim + 2 * model.kv_dim) / tp + FP32 * model.q_dim / tp + z.act * model.dim) * tokens
    # then the block's input norm differentiates in fp32: RMSNorm's autograd makes 5 temporaries of model
    # width (grad x rsqrt, the mean's gradient expanded, pow's x^1, 2 x^1 and its product with the gradient;
    # scripts/memory_trace_cpu.py), counted as 4 as calibrated on the H200 runs. In tiles
    # (memory.tiled_norm_tokens) they are one tile's: on an H200 the moment of a tiled run's peak is
    # the kernel's backward, with no norm tensor live (scripts/cuda_memory_report.py, 256k tokens).
    norm_backward = 0 if z.setup.tiled_norm_tokens else 4 * FP32 * model.dim * tokens
    # One kernel call over the whole sequence (cp 1, and Ulysses over one ring rank) takes GQA's fewer
    # K/V heads itself (cuDNN and flash do; kernels.takes_gqa): its backward then keeps a second fp32
    # buffer of q's size (on an H200, 4,128 MiB where 2,080 without GQA: the Llama-3.2-1B shape at 256k).
    gqa = model.kv_dim * z.kv_copies < model.q_dim
    gqa_workspace = FP32 * model.q_dim / tp * tokens if z.setup.cp == 1 and gqa else 0
    how = "q, k, v, out, their gradients"
    if z.setup.sp > 1 and z.setup.cp == 1:
        # Ulysses alone: the kernel's backward, then the all-to-all of the gradients, one after the other.
        # The kernel's moment holds dout in the head layout and its all-to-all's send buffer, dq, dk, dv
        # there, the kernel's fp32 workspace; the residual's gradient is live at both.
        kernel = (2 * z.act * model.q_dim / tp + _head_layout_qkv(z)) * tokens + FP32 * model.q_dim / tp * tokens
        exchange = ulysses_exchange_per_token(z) * tokens
        residual = z.act * model.dim * tokens
        moments = {"the kernel's backward": kernel + gqa_workspace, "the gradients' all-to-all": exchange,
                   "the norm's fp32 backward": norm_backward}
        largest = max(moments, key=moments.__getitem__)
        return Term("attention working set", _at(0, mlp=recomputed, attention=recomputed + residual + moments[largest]),
                    f"{how}; Ulysses: the larger of the kernel's backward and the gradients' all-to-all "
                    f"(here {largest})")
    # K and V that a GPU holds per token it attends for: under Ulysses 1/sp of the (repeated) heads
    kv_per_token = 2 * z.act * model.kv_dim * z.kv_copies / (tp * z.setup.sp)
    attended = tokens * z.setup.sp  # the cp rank's tokens: what the ring sees after the all-to-all
    if z.setup.cp == 1:
        moved = 0
    elif z.setup.strategy == "allgather":
        moved = 2 * kv_per_token * z.group_tokens
        how = "q, k, v, out, gradients; the whole sequence's K/V" + (" for 1/sp of the heads" if z.setup.sp > 1 else "") + " + its gradient"
    else:
        moved = 4 * kv_per_token * attended
        how = "q, k, v, out, gradients; 2 K/V blocks + 2 gradient blocks"
    # 2D (Ulysses x ring): the ring's buffers and Ulysses' counted together, an upper bound not yet measured apart
    exchange = ulysses_exchange_per_token(z) * tokens
    if exchange:
        how += "; Ulysses: head-layout gradients and all-to-all buffers"
    return Term("attention working set",
                _at(0, mlp=recomputed, attention=recomputed + grads + moved + exchange + max(norm_backward, gqa_workspace)),
                how + ("; the kernel's GQA workspace" if gqa_workspace > norm_backward
                       else "; the norm's fp32 backward" if norm_backward else ""))


def mlp_working_set(z: Sizes) -> Term:
    """In the MLP's backward: its recomputed tensors (with checkpointing), two more of
    intermediate size (the gradients of silu(gate) and up beside that of the product), and
    the gradient of the block's output. Freed before attention's backward."""
    model, tokens = z.model, z.local_tokens
    recomputed = mlp_saved_per_token(z) * tokens if z.setup.activation_checkpointing else 0
    if model.experts:  # for each of the top-k experts: those two gradients, of its output and of its input copy
        k = model.experts_per_token
        gradients = k * z.act * (2 * model.expert_ffn_dim / z.setup.tp + 2 * model.dim)
    else:
        gradients = 2 * z.act * model.ffn_dim / z.setup.tp
    transient = (gradients * _tile_share(z, z.setup.tiled_mlp_tokens) + z.act * model.dim) * tokens
    tiles = f", tiles of {z.setup.tiled_mlp_tokens} tokens" if z.setup.tiled_mlp_tokens else ""
    tensors = f"{'6' if z.setup.activation_checkpointing else '2'} tensors of intermediate size"
    if model.experts:
        tensors += f" for each of {model.experts_per_token} experts, their copies of the tokens"
    return Term("MLP working set", _at(0, mlp=recomputed + transient, attention=0), tensors + tiles)


def loss(z: Sizes) -> Term:
    """Full logits: the logits (bf16, held by the loop until backward ends), their fp32
    log-softmax, its gradient and the fp32 logits' gradient: local tokens x vocab x (2+4+4+4).
    Chunked: the same for one chunk, plus the head's fp32 gradient and the hidden states' gradient.
    Soft-capped logits (Gemma 2) add tanh's output, which its backward keeps: 2 more bytes x vocab.
    Then the final norm's backward (what is left of the loss's, and the norm's fp32 working set):
    the larger of the two is the moment's."""
    model, tokens = z.model, z.local_tokens
    final_norm = final_norm_backward_per_token(z) * tokens
    norm_how = f"; or the final norm's backward ({final_norm_backward_per_token(z) / model.dim:.0f} B x width)"
    capped = z.act if model.logit_softcap is not None else 0  # per logit
    cap_how = f" + {capped} B of tanh (soft-capped logits)" if capped else ""
    if not z.setup.chunked_loss:
        logits = z.act * model.vocab_size * tokens
        held = (3 * FP32 + capped) * model.vocab_size * tokens
        if not z.setup.logits_kept:  # model(labels=...).loss: the output, logits and all, is dropped
            return Term("loss", _at(max(held, final_norm), mlp=0), "logits x (4+4+4) B" + cap_how + norm_how)
        return Term("loss", _at(logits + max(held, final_norm), mlp=logits),
                    f"logits x ({z.act}+4+4+4) B{cap_how}; the {z.dtype} logits stay until backward ends" + norm_how)
    chunk = min(z.setup.loss_chunk_tokens, tokens)
    at_loss = ((4 * FP32 + capped) * model.vocab_size * chunk + FP32 * model.vocab_size * model.dim
               + z.act * model.dim * tokens)
    return Term("loss", _at(max(at_loss, final_norm), mlp=0),
                f"chunks of {chunk} tokens x vocab x 16 B{cap_how}; head's fp32 gradient" + norm_how)


def final_norm_backward_per_token(z: Sizes) -> float:
    """Per token, the model's final norm's backward, the first thing after the loss's backward: its
    fp32 input (back from host memory when offloaded; otherwise counted with the head's inputs in
    `activations`) and RMSNorm's 5 fp32 temporaries of model width. In tiles (memory.tiled_norm_tokens
    tiles it with the blocks' norms) its input is the bf16 hidden state and the temporaries are one
    tile's: the input and its gradient remain."""
    back = 1 if z.setup.offload_activations else 0
    if z.setup.tiled_norm_tokens:
        return (back + 1) * z.act * z.model.dim
    return 5 * FP32 * z.model.dim + back * FP32 * z.model.dim


def offloaded_per_token(z: Sizes) -> float:
    """Per token, what the offload of saved activations moves to host memory: each block's input
    (and what the selective level keeps), the final norm's saved tensors (its fp32 input, kept
    once, its normalized output and the inverse RMS; in tiles only the output, which the head
    keeps: on an H200 at 512k tokens, 34.0 GiB where 38.0 whole), the token ids and position ids
    (int64), and, when the logits are made in the forward, the head's input (and with
    model(labels=...).loss the fp32 log-softmax). Parameters are not copied: FSDP gathers them again for backward. (A
    Hugging Face model's rotary cos and sin, 4 bytes per head dim, are not counted.)"""
    model = z.model
    blocks = model.n_layers * z.act * model.dim + selective_layers(z) * selective_kept_per_token(z)
    final_norm = z.act * model.dim if z.setup.tiled_norm_tokens else FP32 * model.dim + z.act * model.dim + FP32
    head = final_norm + 2 * 8
    if not z.setup.chunked_loss:
        head += z.act * model.dim + (0 if z.setup.logits_kept else FP32 * model.vocab_size)
    return blocks + head


def host_memory(z: Sizes) -> float:
    """Host memory per GPU: the offloaded activations, each at its exact size (cpctl allocates
    them so), and with cpu_offload the sharded parameters, gradients and AdamW state."""
    host = 0.0
    if z.setup.offload_activations and z.setup.activation_checkpointing:
        host += offloaded_per_token(z) * z.local_tokens
    if z.setup.cpu_offload:  # trained weights with their gradients and two AdamW states; a frozen base alone
        host += 4 * z.master * z.trained_params_per_gpu + DTYPE_BYTES[z.base_dtype] * z.frozen_params_per_gpu
    return host


TERMS: tuple[Callable[[Sizes], Term], ...] = (
    parameters, gathered_parameters, gradients, optimizer_state, activations, attention_working_set,
    mlp_working_set, loss,
)
