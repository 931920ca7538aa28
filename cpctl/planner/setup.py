"""What a plan is for (Setup): the layout and memory options of a resolved profile, and the profile
`cpctl plan` resolves from its flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpctl.errors import CpctlError
from cpctl.planner.shapes import FUSED_PROJECTIONS, PROJECTIONS, ModelShape
from cpctl.planner.units import parse_dtype, parse_number
from cpctl.topology import GPUS_PER_NODE, sequence_chunks

ALL_LINEAR = "all-linear"  # peft's target_modules for every linear projection of the blocks, the LM head excluded
KNOWN_PROJECTIONS = (*PROJECTIONS, *(name for name in FUSED_PROJECTIONS if name not in PROJECTIONS))


@dataclass(frozen=True)
class Lora:
    """LoRA fine-tuning as peft's LoraConfig makes it: the base frozen, and on each targeted projection
    of every block two trained adapters, A (rank x in_features) and B (out_features x rank)."""

    rank: int
    targets: tuple[str, ...] = PROJECTIONS  # projection names; all of PROJECTIONS is peft's all-linear
    dropout: float = 0.0  # peft's lora_dropout
    base_dtype: str | None = None  # the frozen weights' dtype; None: the model's own (config.json's dtype)

    @property
    def all_linear(self) -> bool:
        return self.targets == PROJECTIONS

    def targeted(self, projections: Mapping[str, tuple[int, int]]) -> list[str]:
        """Which of a model's `projections` (ModelShape.projections or a part of them) get adapters: every
        one under all-linear (Phi-3's fused ones too), else those named."""
        return [name for name in projections if self.all_linear or name in self.targets]

    def check(self, model: ModelShape) -> None:
        """As peft's get_peft_model refuses targets of which the model has none. A mixture of experts is
        refused: peft adapts its router and its experts' 3D weights (target_parameters) in a layout of its
        own release, which the plan does not count."""
        if model.experts:
            raise CpctlError(f"--lora-rank with {model.name}, a mixture of experts: cpctl plan does not count peft's "
                             "adapters on experts; plan full fine-tuning (without --lora-rank), an upper bound")
        if not self.targeted(model.projections):
            raise CpctlError(f"--lora-targets {','.join(self.targets)}: {model.name} ({model.family}) has no such "
                             f"projection; its projections are {','.join(model.projections)}")

    def params_per_layer(self, model: ModelShape) -> int:
        """The adapters' parameters in one block: what peft's get_peft_model makes trainable there."""
        projections = model.projections
        return sum(self.rank * sum(projections[name]) for name in self.targeted(projections))

    def describe(self) -> str:
        targets = ALL_LINEAR if self.all_linear else ",".join(self.targets)
        return f"LoRA r {self.rank} on {targets}" + (f", dropout {self.dropout:g}" if self.dropout else "")


def parse_lora(*, rank: str | None, targets: str | None = None, dropout: str | None = None,
               base_dtype: str | None = None) -> Lora | None:
    """`cpctl plan`'s LoRA flags as a Lora; None without --lora-rank (full fine-tuning)."""
    if rank is None:
        given = [flag for flag, value in (("--lora-targets", targets), ("--lora-dropout", dropout),
                                          ("--base-dtype", base_dtype)) if value is not None]
        if given:
            raise CpctlError(f"{given[0]} is a LoRA option: pass --lora-rank R too (without it every parameter "
                             "is trained)")
        return None
    chosen = PROJECTIONS
    if targets is not None and targets.strip() != ALL_LINEAR:
        names = [name.strip() for name in targets.split(",") if name.strip()]
        unknown = [name for name in names if name not in KNOWN_PROJECTIONS]
        if unknown or not names:
            missing = f"no projection {unknown[0]}" if unknown else "no projection named"
            raise CpctlError(f"--lora-targets {targets}: {missing}; write {ALL_LINEAR} or some of "
                             f"{','.join(PROJECTIONS)} (peft's target_modules names; Phi-3's fused "
                             f"{','.join(name for name in FUSED_PROJECTIONS if name not in PROJECTIONS)})")
        chosen = tuple(name for name in KNOWN_PROJECTIONS if name in names)
    probability = 0.0
    if dropout is not None:
        probability = parse_number(dropout, what="--lora-dropout", minimum=0)
        if probability >= 1:
            raise CpctlError(f"--lora-dropout {dropout}: a probability below 1 (peft's lora_dropout), e.g. 0.05")
    return Lora(rank=int(parse_number(rank, what="--lora-rank", integer=True)), targets=chosen, dropout=probability,
                base_dtype=None if base_dtype is None else parse_dtype(base_dtype, what="--base-dtype"))


@dataclass(frozen=True)
class Setup:
    """What a plan is for: the layout and the memory options of a resolved profile."""

    gpus: int = 1
    gpus_per_node: int = GPUS_PER_NODE  # GPUs of one machine: they share its host memory, and Ulysses' all-to-all stays on its NVLink
    cp: int = 1
    sp: int = 1  # Ulysses: heads split inside attention, the cp rank's tokens split outside it
    dp_shard: int = 1
    tp: int = 1
    strategy: str = "allgather"
    load_balance: bool = True  # cp_load_balance: head-tail chunks, 2 per cp rank (what a length must divide into)
    precision: str = "bf16"  # bf16 | fp16 | no
    master_weights: str = "fp32"  # fp32 | keep: trainable parameters, gradients, AdamW state in the model's own dtype
    activation_checkpointing: bool = True
    checkpoint_level: str = "full"  # selective: attention's saved tensors are kept, not recomputed; mixed: a mix
    selective_blocks: int | None = None  # under mixed: how many blocks (the last ones) are selective; None: as fit
    reshard_after_forward: bool = True
    chunked_loss: bool = False
    loss_chunk_tokens: int = 4096
    tiled_mlp_tokens: int = 0
    tiled_norm_tokens: int = 0  # the norms in tiles (blocks' and final): their fp32 copies and backward for one tile
    offload_activations: bool = False
    cpu_offload: bool = False
    batch: int = 1  # sequences per CP group in one step
    logits_kept: bool = True  # the loop holds the logits until backward ends (not with model(labels=...).loss)
    first_step: bool = False  # AdamW's state does not exist until the first optimizer step
    lora: Lora | None = None  # None: full fine-tuning, every parameter trained

    @classmethod
    def from_profile(cls, profile: Any, *, chunked_loss: bool = False, batch: int = 1) -> Setup:
        memory = profile.memory
        return cls(
            gpus=profile.world_size, gpus_per_node=profile.launch.nproc_per_node, cp=profile.parallelism.cp_size,
            sp=getattr(profile.parallelism, "sp_size", 1),
            dp_shard=profile.parallelism.dp_shard_size,
            tp=profile.parallelism.tp_size, strategy=profile.parallelism.cp_comm_strategy,
            load_balance=getattr(profile.parallelism, "cp_load_balance", True),
            precision=profile.fsdp.mixed_precision, activation_checkpointing=profile.fsdp.activation_checkpointing,
            master_weights=getattr(profile.fsdp, "master_weights", "fp32"),
            reshard_after_forward=profile.fsdp.reshard_after_forward, chunked_loss=chunked_loss,
            checkpoint_level=getattr(memory, "checkpoint_level", "full"),
            selective_blocks=_count_or_none(getattr(memory, "selective_blocks", None)),
            loss_chunk_tokens=memory.loss_chunk_tokens, tiled_mlp_tokens=getattr(memory, "tiled_mlp_tokens", 0),
            tiled_norm_tokens=getattr(memory, "tiled_norm_tokens", 0),
            offload_activations=getattr(memory, "offload_activations", False),
            cpu_offload=getattr(memory, "cpu_offload", False), batch=batch,
        )

    def with_cp(self, gpus: int) -> Setup:
        """All `gpus` on CP: one FSDP shard per CP rank, no TP or replicas; machines of this many GPUs."""
        return dataclasses.replace(self, gpus=gpus, cp=gpus, sp=1, dp_shard=1, tp=1,
                                   gpus_per_node=min(gpus, max(self.gpus_per_node, 1)))

    def with_sp(self, gpus: int, sp: int) -> Setup:
        """All `gpus` split sequences: Ulysses over `sp` of them, the ring over the rest."""
        return dataclasses.replace(self, gpus=gpus, cp=gpus // sp, sp=sp, dp_shard=1, tp=1,
                                   gpus_per_node=min(gpus, max(self.gpus_per_node, 1)))

    @property
    def workers_per_node(self) -> int:
        """The workers of one machine, which share its host memory: no more than the GPUs of the setup."""
        return max(1, min(self.gpus, self.gpus_per_node))

    @property
    def seq_ranks(self) -> int:
        """How many GPUs split one sequence: cp x sp."""
        return self.cp * self.sp

    @property
    def sequence_chunks(self) -> int:
        """What a sequence's length must be a multiple of (the runtime pads it to one): its chunks over cp x sp."""
        return sequence_chunks(cp=self.cp, sp=self.sp, load_balance=self.load_balance)

    def describe(self) -> str:
        others = self.seq_ranks * self.dp_shard * self.tp
        options = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}: cp {self.cp}" + (f" x sp {self.sp}" if self.sp > 1 else "")
                   + f" x dp_shard {self.dp_shard}"
                   + (f" x tp {self.tp}" if self.tp > 1 else "")
                   + (f" x dp_replicate {self.gpus // others}" if self.gpus > others else ""),
                   (self.strategy if self.cp > 1 else "no CP") + (", Ulysses" if self.sp > 1 else "")
                   + (" without load balance" if self.cp > 1 and not self.load_balance else ""),
                   {"no": "fp32"}.get(self.precision, self.precision)
                   + (", master weights in the model's dtype (keep)" if self.master_weights == "keep" else ""),
                   f"activation checkpointing {self._checkpointing()}",
                   f"loss chunked ({self.loss_chunk_tokens} tokens)" if self.chunked_loss else "full logits in the loss"]
        if not self.reshard_after_forward:
            options.append("blocks stay gathered after forward")
        if self.tiled_mlp_tokens:
            options.append(f"MLP in tiles of {self.tiled_mlp_tokens} tokens")
        if self.tiled_norm_tokens:
            options.append(f"norms in tiles of {self.tiled_norm_tokens} tokens")
        if self.offload_activations:
            options.append("activations offloaded")
        if self.cpu_offload:
            options.append("parameters and optimizer on CPU")
        if self.lora is not None:
            options.append(self.lora.describe())
        return ", ".join(options)

    def _checkpointing(self) -> str:
        if not self.activation_checkpointing:
            return "off"
        if self.checkpoint_level == "mixed":
            count = "as many as fit" if self.selective_blocks is None else f"the last {self.selective_blocks}"
            return f"selective for {count} blocks, full for the rest"
        return "on" if self.checkpoint_level == "full" else self.checkpoint_level


def _count_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


MEMORY_OPTIONS = ("checkpoint_level", "selective_blocks", "tiled_mlp_tokens", "tiled_norm_tokens", "offload_activations",
                  "cpu_offload")  # read where the profile has them


def available_options() -> frozenset[str]:
    """The memory options of the profile schema beyond loss chunking that this cpctl knows."""
    from cpctl.config import KEYS

    return frozenset(name for name in MEMORY_OPTIONS if f"memory.{name}" in KEYS)


@dataclass(frozen=True)
class ResolvedSetup:
    """A Setup as `cpctl plan` resolved it from a profile, with what it says about the resolution."""

    setup: Setup
    target: str  # the machine the profile was resolved for, in words
    note: str | None  # what --gpus changed
    model: str | None = None  # the profile's model (--model)
    split: str | None = None  # why sp x cp is what it is, when sp_size auto chose it


def resolve_setup(*, flags: Mapping[str, str], config: str | Path | None = None, profile_name: str | None = None,
                  gpus: int | None = None, chunked_loss: bool = False, logits_kept: bool = True, batch: int = 1,
                  lora: Lora | None = None, environ: Mapping[str, str] | None = None,
                  cwd: str | Path | None = None) -> ResolvedSetup:
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
        machines = ""
        if "launch.nnodes" not in values and gpus > GPUS_PER_NODE and gpus % GPUS_PER_NODE == 0:
            nnodes = gpus // GPUS_PER_NODE  # nodes of 8, as GPUs come; Ulysses stays inside one
            extra["launch.nnodes"] = str(nnodes)
            machines = f" on {nnodes} nodes of {GPUS_PER_NODE} (--nnodes for others)"
        extra["launch.nproc_per_node"] = str(gpus // nnodes)
        if "parallelism.cp_size" not in flags:
            sp = values.get("parallelism.sp_size", 1)  # auto: sp is taken out of cp_size's ranks
            others = (values.get("parallelism.tp_size", 1) * values.get("parallelism.dp_replicate_size", 1)
                      * (1 if sp == AUTO else sp))
            if gpus % others:
                raise CpctlError(f"--gpus {gpus} is not a multiple of tp x dp_replicate x sp = {others}")
            extra["parallelism.cp_size"] = str(gpus // others)
            note = f"--gpus {gpus}{machines}: {'sequence ranks' if sp == AUTO else 'cp'} {gpus // others}"
        if "parallelism.dp_shard_size" not in flags:
            extra["parallelism.dp_shard_size"] = AUTO
    if int(extra.get("launch.nnodes", values.get("launch.nnodes", 1))) > 1 and not values.get("launch.rdzv_endpoint"):
        extra["launch.rdzv_endpoint"] = "node0:29500"  # what a launch needs; a plan rendezvous with nobody
    shown = preview(flags={**flags, **extra}, config=config, profile_name=profile_name, environ=environ, cwd=cwd)
    setup = dataclasses.replace(Setup.from_profile(shown.resolved.profile, chunked_loss=chunked_loss, batch=batch),
                                logits_kept=logits_kept, lora=lora)
    return ResolvedSetup(setup, shown.target, note, model=shown.resolved.profile.model,
                         split=shown.resolved.auto_reason("parallelism.sp_size"))
