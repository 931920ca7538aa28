"""Fused attention kernels that return the log-sum-exp, behind one small interface.

Each CP block is computed by a fused SDPA kernel that also returns the log-sum-exp (LSE) of
its scores, so partial results over different K/V blocks can be merged exactly and no S x S
score matrix is ever built. The backward op is handed the *merged* output and LSE: each
block's gradients are then exactly its share of the full-sequence gradients.

LSE is normalised to fp32 of shape (batch, heads, seq_q); kernels that want another shape
(cuDNN: (B, H, S, 1)) get it converted back in their backward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.attention

aten = torch.ops.aten


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# Every kernel below runs without dropout: CP attention has none (RouteSDPA refuses
# dropout_p > 0, and neither `Kernel.forward` nor `Kernel.backward` takes a dropout
# argument), so each aten call gets NO_DROPOUT and nothing else.
NO_DROPOUT = 0.0

# ----------------------------------------------------------------------------- CPU flash


def _cpu_forward(q, k, v, *, causal: bool, scale: float):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, NO_DROPOUT, causal, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, NO_DROPOUT, causal, scale=scale
    )


# ----------------------------------------------------------------------------- CUDA kernels

# Each CUDA backward op also takes auxiliary outputs of its forward: the dropout RNG state
# (read only when dropout_p > 0) and cumulative sequence lengths (only for nested/varlen
# inputs; for dense ones the forward returns None and the backward takes None). A block's
# backward is not paired with one forward call (it gets the merged out and LSE of the whole
# row), so each backward builds its own placeholders for the no-dropout case rather than
# keep any forward's. Without dropout the forwards return (torch 2.11, H200): cuDNN and the
# efficient kernel one int64 scalar each for seed and offset (efficient: on the CPU), flash
# a (2,) uint64 RNG state and an unused uint64 scalar; the placeholders below are zeros on
# the kernel's device. `verify` runs every backward with them against autograd SDPA before a
# kernel is used.


def _long_scalars(device) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's and the efficient kernel's (philox_seed, philox_offset) without dropout."""
    return torch.zeros((), dtype=torch.long, device=device), torch.zeros((), dtype=torch.long, device=device)


def _flash_rng(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel's (rng_state, unused) without dropout."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _cudnn_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, NO_DROPOUT, causal, False, scale=scale)
    return out, lse.view(lse.shape[0], lse.shape[1], lse.shape[2])  # cuDNN's LSE is (B, H, S, 1)


def _cudnn_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    seed, offset = _long_scalars(q.device)
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None,
        q.shape[2], k.shape[2], NO_DROPOUT, causal, scale=scale,
    )


def _flash_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, NO_DROPOUT, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    rng_state, unused = _flash_rng(q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], NO_DROPOUT, causal, rng_state, unused,
        scale=scale,
    )


def _efficient_forward(q, k, v, *, causal: bool, scale: float):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, NO_DROPOUT, causal, scale=scale)
    return out, lse[:, :, : q.shape[2]]  # the kernel pads LSE's seq dim to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    seed, offset = _long_scalars(q.device)
    padded = (q.shape[2] + 31) // 32 * 32
    lse_padded = torch.nn.functional.pad(lse, (0, padded - lse.shape[2]))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse_padded, seed, offset, NO_DROPOUT, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, dk, dv


KERNELS = {
    "cpu_flash": Kernel("cpu_flash", _cpu_forward, _cpu_backward),
    "cudnn": Kernel("cudnn", _cudnn_forward, _cudnn_backward),
    "flash": Kernel("flash", _flash_forward, _flash_backward),
    "efficient": Kernel("efficient", _efficient_forward, _efficient_backward),
}

# cuDNN ran 1.7x faster than flash on H100/H200 (docs/runtime.md); fall back in this order.
CUDA_PREFERENCE = ("cudnn", "flash", "efficient")
_pinned: str | None = None


@contextlib.contextmanager
def pinned_kernel(name: str | None):
    """Inside: every CP block on CUDA uses kernel `name` (benchmarks compare them); None: the automatic choice.

    The pin holds for the whole process while the block runs, backward passes included
    (autograd runs those on its own threads), and is undone on exit.
    """
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose one of {', '.join(KERNELS)}")
    global _pinned
    before, _pinned = _pinned, name
    try:
        yield
    finally:
        _pinned = before


def kernel_for(q: torch.Tensor) -> Kernel:
    if q.device.type == "cpu":
        return KERNELS["cpu_flash"]
    if q.device.type != "cuda":
        raise NotImplementedError(f"cpctl CP attention runs on cpu and cuda, not {q.device.type}")
    names = (_pinned,) if _pinned else CUDA_PREFERENCE
    return _first_working(names, q.dtype, q.shape[-1], q.device.index)


@functools.lru_cache(maxsize=None)
def _first_working(names: tuple[str, ...], dtype: torch.dtype, head_dim: int, device_index: int | None) -> Kernel:
    failures = []
    for name in names:
        problem = _problem(name, dtype, head_dim, device_index)
        if problem is None:
            return KERNELS[name]
        failures.append(f"{name}: {problem}")
    raise RuntimeError("no fused attention kernel works here: " + "; ".join(failures))


@functools.lru_cache(maxsize=None)
def _problem(name: str, dtype: torch.dtype, head_dim: int, device_index: int | None) -> str | None:
    """`verify` of one CUDA kernel, once per dtype, head size and device.

    Checking the gradients, not only that the call runs, guards against private-op
    signatures that shift between torch releases.
    """
    return verify(KERNELS[name], device=torch.device("cuda", device_index), dtype=dtype, head_dim=head_dim)


def verify(kernel: Kernel, *, device: torch.device, dtype: torch.dtype, head_dim: int, heads: int = 2,
           kv_heads: int = 2) -> str | None:
    """None if `kernel` gives SDPA's output and gradients on a small causal block of `heads` query
    heads and `kv_heads` K/V heads (fewer: the kernel's own GQA, K/V not widened), else why not."""
    gen = torch.Generator(device=device).manual_seed(0)
    # Seq-major views at an offset into a larger buffer: the layout the engine hands kernels.
    q, k, v, dout = (
        torch.randn(2, 320, count, head_dim, device=device, dtype=dtype, generator=gen)[1:, 64:].transpose(1, 2)
        for count in (heads, kv_heads, kv_heads, heads)
    )
    # The first call may come inside an autograd Function's forward, and inside a checkpointed
    # block: compute the reference with grad on and with identity saved-tensor hooks, so the
    # checkpoint does not count this side computation among the block's saved tensors.
    # The reference is spelled out in matmuls, not as an SDPA call: inside maybe_context_parallel
    # an SDPA call is routed to the CP engine, which would check its kernels again, in fp64.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
        groups = heads // kv_heads
        ref = _causal_attention_fp64(ref_inputs[0], expand_kv(ref_inputs[1], groups), expand_kv(ref_inputs[2], groups))
        ref.backward(dout.double())
    expected = [ref.detach(), *(t.grad for t in ref_inputs)]
    try:
        with torch.no_grad():
            out, lse = kernel.forward(q, k, v, causal=True, scale=head_dim**-0.5)
            grads = kernel.backward(dout, q, k, v, out, lse.float().contiguous(), causal=True, scale=head_dim**-0.5)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # surface asynchronous kernel errors here
    except (RuntimeError, IndexError, TypeError) as exc:  # not built for this dtype/arch/head dim/GQA
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    got = [out, *grads]
    if [t.shape for t in got] != [t.shape for t in expected]:
        return f"results of shapes {[tuple(t.shape) for t in got]}, not {[tuple(t.shape) for t in expected]}"
    error = max((g.double() - want).abs().max().item() for g, want in zip(got, expected))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return None if error <= tolerance else f"wrong results (max error {error:.3g})"


@functools.lru_cache(maxsize=None)
def takes_gqa(kernel: Kernel, dtype: torch.dtype, head_dim: int, device: torch.device, groups: int) -> bool:
    """Whether `kernel` computes grouped-query attention itself (`groups` q heads to a K/V head, the
    gradients back at K/V's size): checked once per group size, as `verify` checks a kernel. Widened,
    K/V and their gradients are 4 tensors of q's size in the backward, its largest part at long lengths.
    Two K/V heads, so that the check also tells which q heads share one (consecutive ones, as
    `expand_kv` and Hugging Face's repeat_kv have it) from any other grouping."""
    return verify(kernel, device=device, dtype=dtype, head_dim=head_dim, heads=2 * groups, kv_heads=2) is None


def _causal_attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention the plain way (scores, mask, softmax), for `verify`'s reference."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    above = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(above, float("-inf")).softmax(dim=-1) @ v


def seq_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (B, H, S, D) backed by (B, S, H, D) memory, as projections produce it.

    Then every slice along the sequence is one dense stretch of memory that the kernels
    read in place, and no block needs a copy.
    """
    if t.transpose(1, 2).is_contiguous():
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V (B, H, S, D) with each head repeated `groups` times in place (head h becomes heads
    h*groups .. h*groups+groups-1, as GQA groups q heads and Hugging Face's repeat_kv repeats),
    seq-major. The one GQA widening: for kernels that do not take GQA, and for Ulysses' split."""
    if groups == 1:
        return t
    return t.transpose(1, 2).repeat_interleave(groups, dim=2).transpose(1, 2)


def fold_kv_grad(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    by_seq = grad.transpose(1, 2)  # (B, S, Hq, D)
    return by_seq.unflatten(2, (by_seq.shape[2] // groups, groups)).sum(dim=3).transpose(1, 2)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results are merged in fp32, or in the inputs' own dtype where that is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _widening(kernel: Kernel, q: torch.Tensor, k: torch.Tensor) -> int:
    """How many times K/V's heads are repeated for `kernel`: GQA's group size, or 1 where the
    kernel takes GQA itself. K/V travel with their own (fewer) heads either way."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or takes_gqa(kernel, q.dtype, q.shape[-1], q.device, groups):
        return 1
    return groups


def block_forward(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a Q block over one K/V block: (out, lse of shape (B, H, Sq) in the accumulation dtype)."""
    kernel = kernel_for(q)
    groups = _widening(kernel, q, k)
    out, lse = kernel.forward(q, expand_kv(k, groups), expand_kv(v, groups), causal=causal, scale=scale)
    return out, lse.to(accumulation_dtype(q.dtype))


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """Gradients of one block, given the *merged* out and lse of the whole row."""
    kernel = kernel_for(q)
    groups = _widening(kernel, q, k)
    dq, dk, dv = kernel.backward(dout, q, expand_kv(k, groups), expand_kv(v, groups), out, lse.contiguous(),
                                 causal=causal, scale=scale)
    return dq, fold_kv_grad(dk, groups), fold_kv_grad(dv, groups)


# ----------------------------------------------------------------------------- windowed flash (CUDA)

# On CUDA a rectangle cut by a sliding window's edge is one call of the flash kernel with a
# window, instead of tiles along the edge. Its variable-length form is the one PyTorch's own
# `varlen_attn` uses; each batch row is one sequence of the rectangle's length.


def _rows_as_sequences(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B * L, H, D), the packed layout of the variable-length kernel."""
    b, h, length, d = t.shape
    return t.transpose(1, 2).reshape(b * length, h, d)


def _offsets(batch: int, length: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def window_forward(q, k, v, *, left: int, right: int, scale: float):
    """Query i sees key j iff i + (Lk - Lq) - left <= j <= i + (Lk - Lq) + right; (out, lse (B, H, Lq))."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    out, lse, _, _, _ = aten._flash_attention_forward(
        _rows_as_sequences(q), _rows_as_sequences(k), _rows_as_sequences(v), _offsets(b, lq, q.device),
        _offsets(b, lk, q.device), lq, lk, NO_DROPOUT, False, False, scale=scale, window_size_left=left,
        window_size_right=right)
    return out.view(b, lq, h, d).transpose(1, 2), lse.view(h, b, lq).transpose(0, 1)


def window_backward(dout, q, k, v, out, lse, *, left: int, right: int, scale: float):
    b, h, lq, d = q.shape
    lk = k.shape[2]
    rng_state, unused = _flash_rng(q.device)
    dq, dk, dv = aten._flash_attention_backward(
        _rows_as_sequences(dout), _rows_as_sequences(q), _rows_as_sequences(k), _rows_as_sequences(v),
        _rows_as_sequences(out), lse.transpose(0, 1).reshape(h, b * lq).contiguous(), _offsets(b, lq, q.device),
        _offsets(b, lk, q.device), lq, lk, NO_DROPOUT, False, rng_state, unused, scale=scale,
        window_size_left=left, window_size_right=right)
    return (dq.view(b, lq, h, d).transpose(1, 2), dk.view(b, lk, h, d).transpose(1, 2),
            dv.view(b, lk, h, d).transpose(1, 2))


def windowed_flash_works(dtype: torch.dtype, head_dim: int, device_index: int | None) -> bool:
    return windowed_flash_problem(dtype, head_dim, device_index) is None


@functools.lru_cache(maxsize=None)
def windowed_flash_problem(dtype: torch.dtype, head_dim: int, device_index: int | None) -> str | None:
    """None if window_forward/backward give the explicit mask's results here (checked once), else why not."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(2, 2, 96, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(4))
    # 80 x 80, the keys starting 16 tokens before the queries
    q, dout, k, v = q[:, :, 16:], dout[:, :, 16:], k[:, :, :80], v[:, :, :80]
    left, right, scale = 20, 16, head_dim ** -0.5
    i, j = torch.arange(80, device=device)[:, None], torch.arange(80, device=device)[None, :]
    allowed = (j >= i - left) & (j <= i + right)
    try:
        with torch.no_grad():
            out, lse = window_forward(q, k, v, left=left, right=right, scale=scale)
            grads = window_backward(dout, q, k, v, out, lse.float().contiguous(), left=left, right=right, scale=scale)
            want_out, want_lse = explicit_forward(q, k, v, allowed=allowed, scale=scale)
            want = explicit_backward(dout, q, k, v, out, want_lse, allowed=allowed, scale=scale)
            torch.cuda.synchronize(device)
    except (RuntimeError, IndexError, TypeError) as exc:  # not built for this dtype/arch, or another schema
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    names = ("out", "lse", "dq", "dk", "dv")
    errors = {n: (a.double() - b.double()).abs().max().item() for n, a, b in zip(names, (out, lse, *grads),
                                                                                (want_out, want_lse, *want))}
    return None if max(errors.values()) <= tolerance else f"wrong results: {errors}"


# ----------------------------------------------------------------------------- explicit tiles


def explicit_forward(q, k, v, *, allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A small tile under an arbitrary (Sq, Sk) boolean mask, in the accumulation dtype.

    Used only where a window or chunk boundary cuts a tile (at most EXPLICIT_TILE square),
    so its score matrix stays small. Rows with no visible key get lse -inf and out 0.
    """
    dtype = accumulation_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype)
    scores = (q.to(dtype) @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return probs @ v, lse


def explicit_backward(dout, q, k, v, out, lse, *, allowed: torch.Tensor, scale: float):
    """Gradients of an explicit tile, given the *merged* out and lse of its rows."""
    dtype = accumulation_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    q32, dout32 = q.to(dtype), dout.to(dtype)
    k32, v32 = expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype)
    scores = (q32 @ k32.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed, float("-inf"))
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))
    dv = probs.transpose(-1, -2) @ dout32
    delta = (dout32 * out.to(dtype)).sum(dim=-1, keepdim=True)
    dscores = probs * (dout32 @ v32.transpose(-1, -2) - delta)
    dq = (dscores @ k32).mul_(scale)
    dk = (dscores.transpose(-1, -2) @ q32).mul_(scale)
    return dq, fold_kv_grad(dk, groups), fold_kv_grad(dv, groups)
