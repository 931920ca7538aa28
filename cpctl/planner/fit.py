"""Whether a step fits: the terms summed at each moment, plus what torch's peak does not count;
the longest sequence that fits, and the fewest GPUs a sequence needs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpctl.errors import CpctlError
from cpctl.planner.setup import Setup
from cpctl.planner.shapes import ModelShape
from cpctl.planner.terms import BLOCK_MOMENTS, MOMENTS, TERMS, Sizes, Term, host_memory
from cpctl.planner.units import GiB

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
# Host memory a CUDA worker holds besides what it offloads (CUDA context, torch and its libraries,
# the data loader): an estimate, counted per worker process of a machine when its offloaded
# tensors are checked against the machine's memory.
WORKER_HOST_GIB = 4.0


@dataclass(frozen=True)
class Estimate:
    model: ModelShape
    setup: Setup
    seq_len: int
    gpu_memory_gib: float
    terms: tuple[Term, ...]
    host_memory_gib: float | None = None  # the machine's; None: host memory is not checked

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
    def fits_gpu(self) -> bool:
        return self.needed <= self.gpu_memory_gib * GiB

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def host_needed(self) -> float:
        """Host memory per machine for what its workers keep there (0 without offload options): each
        GPU's offloaded tensors plus WORKER_HOST_GIB, times the workers of a machine."""
        if not self.host_bytes:
            return 0.0
        return self.setup.workers_per_node * (self.host_bytes + WORKER_HOST_GIB * GiB)

    @property
    def fits_host(self) -> bool:
        return self.host_memory_gib is None or self.host_needed <= self.host_memory_gib * GiB

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
            "host_gib": round(self.host_bytes / GiB, 3), "host_needed_gib": round(self.host_needed / GiB, 3),
            "host_memory_gib": self.host_memory_gib, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
        }


def estimate(model: ModelShape, setup: Setup, seq_len: int, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
             host_memory_gib: float | None = None) -> Estimate:
    """The memory per GPU of one training step of `model` on `seq_len`-token sequences.

    Under checkpoint_level mixed without a count, the count is chosen here: the most selective
    blocks that fit (`estimate(...).setup.selective_blocks` is the count chosen)."""
    if seq_len < 1:
        raise CpctlError(f"sequence length must be at least 1 token, got {seq_len}")
    if setup.lora is not None and setup.tp > 1:  # how peft's adapters split under TP is not modelled
        raise CpctlError(f"cpctl plan counts LoRA without tensor parallelism: pass --tp-size 1 (not {setup.tp})")
    if setup.lora is not None:
        setup.lora.check(model)
    if setup.activation_checkpointing and setup.checkpoint_level == "mixed" and setup.selective_blocks is None:
        return most_selective_blocks(model, setup, seq_len, gpu_memory_gib=gpu_memory_gib,
                                     host_memory_gib=host_memory_gib)
    sizes = Sizes(model, setup, seq_len)
    return Estimate(model, setup, seq_len, gpu_memory_gib, tuple(term(sizes) for term in TERMS), host_memory_gib)


def most_selective_blocks(model: ModelShape, setup: Setup, seq_len: int, *,
                          gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB, host_memory_gib: float | None = None
                          ) -> Estimate:
    """The estimate with the most selective blocks (the last ones) that fit, the others fully
    recomputed; with none (full checkpointing) when not even that fits."""

    def with_count(count: int) -> Estimate:
        chosen = dataclasses.replace(setup, checkpoint_level="mixed", selective_blocks=count)
        return estimate(model, chosen, seq_len, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)

    low, high = 0, model.n_layers  # memory grows with the count: find the largest that fits
    if with_count(high).fits:
        return with_count(high)
    while high - low > 1:  # with_count(high) does not fit; low fits, or is 0
        middle = (low + high) // 2
        low, high = (middle, high) if with_count(middle).fits else (low, middle)
    return with_count(low)


def peak_gib(model: ModelShape, setup: Setup, seq_len: int) -> float:
    return estimate(model, setup, seq_len).peak / GiB


def longest_fitting(model: ModelShape, setup: Setup, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
                    host_memory_gib: float | None = None) -> int:
    """The longest sequence (a multiple of 1024 and of the layout's chunks, Setup.sequence_chunks) that
    fits; 0 if none does."""
    unit = math.lcm(1024, setup.sequence_chunks)

    def fits(units: int) -> bool:
        return estimate(model, setup, units * unit, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib).fits

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
                setup_for: Callable[[int], Setup | None] | None = None,
                gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB, host_memory_gib: float | None = None) -> Estimate | None:
    """The smallest power-of-two GPU count on which `seq_len` fits, or None. `setup_for(gpus)`
    builds the setup for a count (None: that count is not searched); the default puts all of them on CP."""
    setup_for = setup.with_cp if setup_for is None else setup_for
    gpus = 1
    while gpus <= MAX_GPUS:
        candidate = setup_for(gpus) if seq_len * setup.batch >= gpus else None
        if candidate is not None:
            found = estimate(model, candidate, seq_len, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)
            if found.fits:
                return found
        gpus *= 2
    return None
