"""Everything `cpctl plan` prints, in one Plan: the estimate, the advice, and the longest sequence
that fits on each GPU count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cpctl.planner.advice import Suggestion, suggestions
from cpctl.planner.fit import (
    ALLOCATOR_HEADROOM,
    CUDA_OVERHEAD_GIB,
    DEFAULT_GPU_MEMORY_GIB,
    Estimate,
    estimate,
    gpus_needed,
    longest_fitting,
)
from cpctl.planner.hardware import H200, Throughputs
from cpctl.planner.layouts import Layout, choose_layout
from cpctl.planner.ranking import Ranked, rank_layouts
from cpctl.planner.setup import Setup
from cpctl.planner.shapes import ModelShape
from cpctl.planner.terms import Sizes
from cpctl.planner.units import GiB
from cpctl.planner.timing import StepTime, predict

GPU_COUNTS = (1, 2, 4, 8, 16, 32)  # the rows of "longest sequence that fits"


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
    longest_sp: list[tuple[int, Layout, int]] = dataclasses.field(default_factory=list)  # (GPUs, sp x cp, longest)
    layout: Layout | None = None  # the suggested split of this setup's sequence ranks
    needed_sp: Estimate | None = None  # the fewest GPUs for the sequence split as sp x cp (Ulysses), these options
    time: StepTime | None = None  # the step's predicted time with this setup
    ranked: list[Ranked] = dataclasses.field(default_factory=list)  # the layouts that fit, fastest first
    figures: Throughputs = H200  # whose throughputs timed it

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "estimate": self.estimate.to_dict(),
            "suggestions": [s.to_dict() for s in self.suggestions],
            "longest": [{"gpus": g, "cp": g, "seq_len": n, "seq_len_all_options": a} for g, n, a in self.longest],
            "longest_sp": [{"gpus": g, "sp": lay.sp, "cp": lay.cp, "seq_len": n} for g, lay, n in self.longest_sp],
            "layout": None if self.layout is None else {"sp": self.layout.sp, "cp": self.layout.cp,
                                                        "reason": self.layout.reason},
            "gpus_needed": None if self.needed is None else self.needed.setup.gpus,
            "gpus_needed_sp": None if self.needed_sp is None else {
                "gpus": self.needed_sp.setup.gpus, "sp": self.needed_sp.setup.sp, "cp": self.needed_sp.setup.cp},
            "gpus_needed_all_options": None if self.needed_all is None else self.needed_all.setup.gpus,
            "all_options": self.all_options,
            "lora": self.lora_to_dict(),
            "calibration": {"cuda_overhead_gib": CUDA_OVERHEAD_GIB, "allocator_headroom": ALLOCATOR_HEADROOM},
            "time": None if self.time is None else self.time.to_dict(),
            "throughputs": {"name": self.figures.name, "source": self.figures.source},
            "layouts_by_time": [{"layout": entry.label(), "sp": entry.setup.sp, "cp": entry.setup.cp,
                                 "strategy": entry.setup.strategy,
                                 "activation_checkpointing": entry.setup.activation_checkpointing,
                                 "checkpoint_level": entry.setup.checkpoint_level,
                                 "selective_blocks": entry.setup.selective_blocks,
                                 "peak_gib": round(entry.estimate.peak / GiB, 2), **entry.time.to_dict()}
                                for entry in self.ranked],
        }

    def lora_to_dict(self) -> dict[str, Any] | None:
        """LoRA's resolved facts (None for full fine-tuning): the base's dtype as counted, the adapters' size."""
        lora = self.estimate.setup.lora
        if lora is None:
            return None
        sizes = Sizes(self.model, self.estimate.setup, self.estimate.seq_len)
        return {"rank": lora.rank, "targets": list(lora.targets), "dropout": lora.dropout,
                "base_dtype": sizes.base_dtype, "adapter_params": sizes.adapter_params}


def all_free_options(setup: Setup) -> dict[str, Any]:
    """The memory options that cost little speed: checkpointing, a chunked loss, resharding."""
    return {name: True for name in ("activation_checkpointing", "chunked_loss", "reshard_after_forward")
            if not getattr(setup, name)}


def make_plan(model: ModelShape, setup: Setup, seq_len: int, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
              host_memory_gib: float | None = None, available: frozenset[str] = frozenset(),
              figures: Throughputs = H200, document_tokens: int | None = None) -> Plan:
    memory = {"gpu_memory_gib": gpu_memory_gib, "host_memory_gib": host_memory_gib}
    base = estimate(model, setup, seq_len, **memory)
    free = all_free_options(setup)
    better = dataclasses.replace(setup, **free)
    longest = [(gpus, longest_fitting(model, setup.with_cp(gpus), **memory),
                longest_fitting(model, better.with_cp(gpus), **memory) if free else None)
               for gpus in GPU_COUNTS]

    def split(gpus: int) -> Layout:
        """How choose_layout splits `gpus` sequence ranks on this setup's machines (as sp_size auto does)."""
        return choose_layout(model, seq_ranks=gpus, ranks_per_node=setup.gpus_per_node)

    def ulysses(gpus: int) -> Setup | None:
        """All `gpus` splitting sequences as `split` says; None where it chooses the ring alone."""
        layout = split(gpus)
        return setup.with_sp(gpus, layout.sp) if layout.sp > 1 else None

    longest_sp = [(gpus, layout, longest_fitting(model, setup.with_sp(gpus, layout.sp), **memory))
                  for gpus in GPU_COUNTS if (layout := split(gpus)).sp > 1]
    return Plan(
        model=model, estimate=base, longest_sp=longest_sp,
        layout=choose_layout(model, seq_ranks=setup.seq_ranks, ranks_per_node=setup.gpus_per_node, tp=setup.tp),
        suggestions=[] if base.fits else suggestions(base, available=available),
        longest=longest, needed=gpus_needed(model, setup, seq_len, **memory),
        needed_all=gpus_needed(model, better, seq_len, **memory) if free else None,
        all_options=free, needed_sp=gpus_needed(model, setup, seq_len, setup_for=ulysses, **memory),
        time=predict(model, base.setup, seq_len, figures, document_tokens=document_tokens), figures=figures,
        ranked=rank_layouts(model, setup, seq_len, figures, document_tokens=document_tokens, **memory),
    )
