"""The layouts of a setup's GPUs that fit, fastest first: how each sequence's ranks split into Ulysses
x ring, the ring's strategy, and the checkpointing level, each estimated (`fit.py`) and timed
(`timing.py`). The other choices (dp_shard, tp, the memory options) stay as the setup has them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpctl.planner.fit import Estimate, estimate
from cpctl.planner.hardware import Throughputs
from cpctl.planner.setup import Setup
from cpctl.planner.shapes import ModelShape
from cpctl.planner.timing import StepTime, predict
from cpctl.topology import heads_split_problem

LEVELS = ("full", "selective", "mixed")


@dataclass(frozen=True)
class Ranked:
    estimate: Estimate
    time: StepTime

    @property
    def setup(self) -> Setup:
        return self.estimate.setup

    def label(self) -> str:
        setup = self.setup
        split = f"cp {setup.cp}" + (f" x sp {setup.sp}" if setup.sp > 1 else "")
        ring = f", {setup.strategy}" if setup.cp > 1 else ""
        if not setup.activation_checkpointing:
            level = "no checkpointing"
        elif setup.checkpoint_level == "mixed":
            level = f"mixed ({setup.selective_blocks} selective)"
        else:
            level = f"{setup.checkpoint_level} checkpointing"
        return f"{split}{ring}, {level}"


def candidates(model: ModelShape, setup: Setup) -> list[Setup]:
    """Every split of the setup's sequence ranks Ulysses can take inside a node, each ring strategy,
    each checkpointing level (and none)."""
    ranks, slots = setup.seq_ranks, max(1, setup.gpus_per_node // setup.tp)
    splits = [sp for sp in range(1, min(ranks, slots) + 1)
              if ranks % sp == 0 and slots % sp == 0 and heads_split_problem(model.n_heads, sp=sp, tp=setup.tp) is None]
    found = []
    for sp in splits:
        cp = ranks // sp
        for strategy in ("allgather", "alltoall") if cp > 1 else (setup.strategy,):
            layout = dataclasses.replace(setup, sp=sp, cp=cp, strategy=strategy)
            found.append(dataclasses.replace(layout, activation_checkpointing=False))
            found += [dataclasses.replace(layout, activation_checkpointing=True, checkpoint_level=level,
                                          selective_blocks=None) for level in LEVELS]
    return found


def rank_layouts(model: ModelShape, setup: Setup, seq_len: int, figures: Throughputs, *,
                 gpu_memory_gib: float, host_memory_gib: float | None = None,
                 document_tokens: int | None = None) -> list[Ranked]:
    """The candidates that fit, fastest first (mixed with the count of selective blocks that fits;
    a mixed that comes out as all or none of them is the selective or full level, listed once)."""
    ranked, seen = [], set()
    for candidate in candidates(model, setup):
        if seq_len < candidate.sequence_chunks:  # fewer tokens than the split has shards
            continue
        found = estimate(model, candidate, seq_len, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)
        chosen = found.setup
        key = (chosen.sp, chosen.cp, chosen.strategy, chosen.activation_checkpointing,
               _level(chosen, model.n_layers))
        if not found.fits or key in seen:
            continue
        seen.add(key)
        ranked.append(Ranked(found, predict(model, chosen, seq_len, figures, document_tokens=document_tokens)))
    return sorted(ranked, key=lambda entry: entry.time.total)


def _level(setup: Setup, layers: int) -> str:
    if setup.checkpoint_level != "mixed":
        return setup.checkpoint_level
    return {0: "full", layers: "selective"}.get(setup.selective_blocks or 0, f"mixed {setup.selective_blocks}")
