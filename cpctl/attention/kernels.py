"""Fused attention kernels that return the log-sum-exp, behind one small interface.

Each CP block is computed by a fused SDPA kernel that also returns the log-sum-exp (LSE) of
its scores, so partial results over different K/V blocks can be merged exactly and no S x S
score matrix is ever built. The backward op is handed the *merged* output and LSE: each
block's gradients are then exactly its share of the full-sequence gradients.

LSE is normalised to fp32 of shape (batch, heads, seq_q); kernels that want another shape
(cuDNN: (B, H, S, 1)) get it converted back in their backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    native_gqa: bool  # accepts fewer K/V heads than Q heads


# ----------------------------------------------------------------------------- CPU flash


def _cpu_forward(q, k, v, *, causal: bool, scale: float):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


# ----------------------------------------------------------------------------- CUDA cuDNN

_EMPTY = torch.empty(0)


def _cudnn_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse.view(lse.shape[0], lse.shape[1], lse.shape[2])


def _cudnn_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    seed = offset = _EMPTY.to(q.device)
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, _EMPTY.to(q.device),
        _EMPTY.to(q.device), _EMPTY.to(q.device), q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )


# ----------------------------------------------------------------------------- CUDA flash


def _flash_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    empty = _EMPTY.to(q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal, empty, empty,
        scale=scale,
    )


# ----------------------------------------------------------------------------- CUDA efficient


def _efficient_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[:, :, : q.shape[2]]  # the kernel pads LSE's seq dim to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    empty = _EMPTY.to(q.device)
    padded = (q.shape[2] + 31) // 32 * 32
    lse_padded = torch.nn.functional.pad(lse, (0, padded - lse.shape[2]))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, empty, out, lse_padded, empty, empty, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, dk, dv


KERNELS = {
    "cpu_flash": Kernel("cpu_flash", _cpu_forward, _cpu_backward, native_gqa=False),
    "cudnn": Kernel("cudnn", _cudnn_forward, _cudnn_backward, native_gqa=False),
    "flash": Kernel("flash", _flash_forward, _flash_backward, native_gqa=False),
    "efficient": Kernel("efficient", _efficient_forward, _efficient_backward, native_gqa=False),
}

# cuDNN is 1.7x faster than flash on H200 (shared/MEASURED.md); fall back in this order.
CUDA_PREFERENCE = ("cudnn", "flash", "efficient")
_forced: str | None = None


def force_kernel(name: str | None) -> None:
    """Pin the CUDA kernel (benchmarks compare them); None returns to automatic choice."""
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose one of {', '.join(KERNELS)}")
    global _forced
    _forced = name
    _probe.cache_clear()


def kernel_for(q: torch.Tensor) -> Kernel:
    if q.device.type == "cpu":
        return KERNELS["cpu_flash"]
    if q.device.type != "cuda":
        raise NotImplementedError(f"cpctl CP attention runs on cpu and cuda, not {q.device.type}")
    return _probe(q.dtype, q.shape[-1], q.device.index)


@functools.lru_cache(maxsize=None)
def _probe(dtype: torch.dtype, head_dim: int, device_index: int | None) -> Kernel:
    """The first CUDA kernel that runs forward and backward on a tiny block of this kind."""
    names = (_forced,) if _forced else CUDA_PREFERENCE
    device = torch.device("cuda", device_index)
    failures = []
    for name in names:
        kernel = KERNELS[name]
        try:
            q = torch.randn(1, 2, 128, head_dim, device=device, dtype=dtype)
            out, lse = kernel.forward(q, q, q, causal=True, scale=head_dim**-0.5)
            kernel.backward(torch.ones_like(out), q, q, q, out, lse, causal=True, scale=head_dim**-0.5)
            return kernel
        except RuntimeError as exc:  # kernel not built for this dtype/arch/head dim
            failures.append(f"{name}: {str(exc).splitlines()[0]}")
    raise RuntimeError("no fused attention kernel runs here: " + "; ".join(failures))


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_kv_grad(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(dim=2)


def block_forward(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a Q block over one K/V block: (out, fp32 lse of shape (B, H, Sq))."""
    kernel = kernel_for(q)
    groups = q.shape[1] // k.shape[1]
    if not kernel.native_gqa:
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    return out, lse.float()


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """Gradients of one block, given the *merged* out and lse of the whole row."""
    kernel = kernel_for(q)
    groups = q.shape[1] // k.shape[1]
    if not kernel.native_gqa:
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    if not kernel.native_gqa:
        dk, dv = _fold_kv_grad(dk, groups), _fold_kv_grad(dv, groups)
    return dq, dk, dv
