"""What a GPU and its links do per second, as the step-time model (`timing.py`) needs it: built-in
figures for the H200 and H100, or a calibration measured on the user's own GPU (`cpctl plan
--calibrate`, `calibration.py`), cached as JSON.

Each figure is a throughput a real kernel reaches, not a datasheet peak: bf16 matmuls of a
transformer's shapes, attention's forward and backward by head dimension (FLOPs counted as 4 x
queries x visible keys x heads x head dim for the forward, 2.5x that for the backward), elementwise
traffic over HBM, pinned copies over PCIe, AdamW on the host (`cpu_offload`). The links between
GPUs cannot be measured on one: NVLink within a node and the network between nodes are options
(`--nvlink-gbps`, `--network-gbps`) with the defaults of an HGX node and 8 x 400 Gb/s NICs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpctl.errors import CpctlError

HEAD_DIMS = (64, 96, 128, 256)  # the head dims calibrated; others are interpolated


@dataclass(frozen=True)
class Throughputs:
    """One GPU's achieved throughputs, and its links'."""

    name: str
    source: str  # where the figures come from, in words
    matmul_tflops: float  # bf16 GEMMs of a block's projections
    attention_forward_tflops: dict[int, float]  # by head dim: causal calls of `attention_calibrated_keys` tokens
    attention_backward_tflops: dict[int, float]
    hbm_gbps: float  # elementwise kernels (norms, rotary, activations, casts, the loss's softmax)
    pcie_gbps: float  # pinned host <-> device copies (offload_activations, cpu_offload)
    host_adam_params_per_s: float  # torch's AdamW on the host as it runs by default there (per tensor), fp32 (cpu_offload)
    nvlink_gbps: float = 370.0  # per GPU, NCCL bus bandwidth of all-gather / reduce-scatter / all-to-all in a node
    network_gbps: float = 45.0  # per GPU across nodes (8 x 400 Gb/s NICs per node of 8)
    # A kernel call of few queries runs below the long-call rate: rate x n / (n + this), n queries per call
    # (emulated ring ranks on one H200: 2k-token blocks at 0.35-0.6 of a 32k call's rate).
    attention_half_rate_tokens: int = 1500
    # Long calls' forward slows down as the sequence grows (the backward does not): the share of its rate
    # lost per doubling of the keys beyond `attention_calibrated_keys`, by head dim, measured at 8x that.
    attention_forward_falloff: dict[int, float] = dataclasses.field(default_factory=dict)
    attention_calibrated_keys: int = 32768
    # A rectangle (no mask inside: another rank's K/V) runs faster than a causal call, per FLOP.
    rectangle_attention_gain: float = 1.047
    # Masks the dense kernel cannot take (sliding windows, packed documents) run on the flash kernel with
    # a window or variable lengths: its rate as a share of the dense kernel's.
    masked_attention_share: float = 0.584
    # A mixture of experts' routing (sort, gather and scatter each token's copies: transformers' experts
    # dispatch), per token and chosen expert, per layer and forward-equivalent pass (backward counts 2).
    expert_dispatch_s: float = 95e-9
    # A mixture of experts' grouped GEMMs (torch._grouped_mm, as transformers runs experts); None: the dense rate.
    expert_matmul_tflops: float | None = None
    # Host-side launch cost of a transformer block's forward (about 40 kernel launches, Python, hooks),
    # once per forward, recompute and backward: what bounds short steps.
    block_launch_s: float = 0.0015

    def attention_rate(self, head_dim: int, *, backward: bool, keys: int | None = None) -> float:
        """FLOP/s of a long attention call at this head dim, over `keys` keys (default: as calibrated)."""
        if backward:
            return 1e12 * _by_head_dim(self.attention_backward_tflops, head_dim)
        rate = 1e12 * _by_head_dim(self.attention_forward_tflops, head_dim)
        if keys is None or keys <= self.attention_calibrated_keys or not self.attention_forward_falloff:
            return rate
        lost = _by_head_dim(self.attention_forward_falloff, head_dim) * math.log2(keys / self.attention_calibrated_keys)
        return rate * max(0.5, 1.0 - lost)

    @property
    def grouped_matmul_tflops(self) -> float:
        return self.matmul_tflops if self.expert_matmul_tflops is None else self.expert_matmul_tflops

    def with_links(self, *, nvlink_gbps: float | None = None, network_gbps: float | None = None) -> Throughputs:
        changes = {name: value for name, value in (("nvlink_gbps", nvlink_gbps), ("network_gbps", network_gbps))
                   if value is not None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Throughputs:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {name: value for name, value in data.items() if name in fields}
        for table in ("attention_forward_tflops", "attention_backward_tflops", "attention_forward_falloff"):
            values[table] = {int(dim): float(rate) for dim, rate in values.get(table, {}).items()}
        return cls(**values)


def _by_head_dim(table: dict[int, float], head_dim: int) -> float:
    """A figure at this head dim: the table's, or interpolated linearly between the nearest two (clamped at the ends)."""
    dims = sorted(table)
    if head_dim <= dims[0] or head_dim >= dims[-1]:
        return table[dims[0] if head_dim <= dims[0] else dims[-1]]
    low = max(d for d in dims if d <= head_dim)
    high = min(d for d in dims if d >= head_dim)
    if low == high:
        return table[low]
    return table[low] + (head_dim - low) / (high - low) * (table[high] - table[low])


# Measured on one H200 (torch 2.11, cuDNN attention, 2026-12-03) by `cpctl plan --calibrate`; see
# docs/benchmarks.md "Step time".
H200 = Throughputs(
    name="NVIDIA H200", source="built-in: measured on one H200 (cpctl plan --calibrate, torch 2.11, 2026-12-03)",
    matmul_tflops=790.0,
    attention_forward_tflops={64: 483.0, 96: 495.0, 128: 611.0, 256: 650.0},
    attention_backward_tflops={64: 416.0, 96: 428.0, 128: 539.0, 256: 388.0},
    attention_forward_falloff={64: 0.034, 128: 0.045}, rectangle_attention_gain=1.047, masked_attention_share=0.584,
    hbm_gbps=4220.0, pcie_gbps=55.3, host_adam_params_per_s=0.845e9, expert_matmul_tflops=773.0,
)
# The H100 SXM has the H200's compute at 3.35 of its 4.8 TB/s memory bandwidth: its compute figures
# are the H200's and its memory-bound ones scaled by that ratio (not measured: no H100 is lent here).
H100 = dataclasses.replace(
    H200, name="NVIDIA H100", source="built-in: the H200's figures, HBM scaled to the H100's 3.35 TB/s (not measured)",
    hbm_gbps=H200.hbm_gbps * 3.35 / 4.8)
BUILT_IN = {"h200": H200, "h100": H100}


def cache_path() -> Path:
    """Where `cpctl plan --calibrate` keeps what it measured: $XDG_CACHE_HOME/cpctl/throughputs.json."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "cpctl" / "throughputs.json"


def save_calibration(figures: Throughputs, path: Path | None = None) -> Path:
    path = cache_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures.to_dict(), indent=2) + "\n")
    return path


def load_calibration(path: Path | None = None) -> Throughputs | None:
    """The cached calibration, or None if there is none; a damaged file is one line naming the fix."""
    path = cache_path() if path is None else path
    if not path.is_file():
        return None
    try:
        return Throughputs.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise CpctlError(f"{path}: not a calibration cpctl wrote ({exc}); run cpctl plan --calibrate again, "
                         "or delete the file to use the built-in figures") from None


def throughputs_for(gpu: str | None = None) -> Throughputs:
    """The figures a plan uses: `gpu` names the built-in ones (h200, h100) or 'calibrated' (the cache);
    None: the cached calibration if there is one, else the H200's."""
    if gpu is None:
        return load_calibration() or H200
    key = gpu.strip().lower()
    if key == "calibrated":
        found = load_calibration()
        if found is None:
            raise CpctlError(f"--gpu calibrated: no calibration in {cache_path()}; run cpctl plan --calibrate on the "
                             f"GPU first, or pass --gpu {' or '.join(BUILT_IN)}")
        return found
    if key not in BUILT_IN:
        raise CpctlError(f"--gpu {gpu}: cpctl knows {', '.join(BUILT_IN)} (or 'calibrated': cpctl plan --calibrate "
                         "measures yours)")
    return BUILT_IN[key]
