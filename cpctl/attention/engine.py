"""cpctl's context-parallel attention: an autograd function over the two strategies.

Inputs are this rank's shards, (batch, heads, local_seq, head_dim), of a self-attention
whose sequence is split over the CP group as `ChunkLayout` says. The result equals
single-process SDPA on the full sequence, restricted to this rank's queries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import cpctl.attention.allgather as allgather
import cpctl.attention.ring as ring
from cpctl.attention.kernels import seq_major
from cpctl.attention.masks import Mask
from cpctl.attention.sharding import ChunkLayout
from cpctl.attention.spec import AttentionSpec, Strategy
from cpctl.attention.whole import WholeSequenceAttention
from cpctl.errors import CpctlError

STRATEGIES = {Strategy.ALLGATHER: allgather, Strategy.RING: ring}


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: AttentionSpec):
        q, k, v = seq_major(q), seq_major(k), seq_major(v)
        out, lse = STRATEGIES[spec.strategy].forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = STRATEGIES[ctx.spec.strategy].backward(seq_major(dout), q, k, v, out, lse, ctx.spec)
        return dq, dk, dv, None


def _document_rows(documents, *, batch: int) -> list[tuple[int, ...] | None]:
    """One tuple of document starts per batch row; None for a row that is one document."""
    rows = _per_row(documents, batch=batch, what="documents")
    rows = [None if row is None else tuple(int(start) for start in row) for row in rows]
    return [None if row == (0,) else row for row in rows]


def _hidden_rows(hidden_keys, *, batch: int) -> list[tuple[tuple[int, int], ...] | None]:
    """One tuple of hidden key ranges per batch row; None for a row without padding."""
    rows = [tuple((int(a), int(b)) for a, b in row or ()) for row in _per_row(hidden_keys, batch=batch, what="hidden keys")]
    return [row or None for row in rows]


def _per_row(values, *, batch: int, what: str) -> list:
    if values is None:
        return [None] * batch
    if len(values) not in (1, batch):
        raise CpctlError(f"CP attention: {what} for {len(values)} rows, but the batch has {batch}")
    return list(values) * batch if len(values) == 1 else list(values)


def _as_autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under autocast SDPA computes in the autocast dtype (q from RoPE may be fp32, v bf16): so does CP attention."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))  # others are refused by the check
    return q, k, v


def checked_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: ChunkLayout,
                   enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the dtype attention computes in (autocast's, as SDPA's), once checked to fit together."""
    q, k, v = _as_autocast(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise CpctlError(
            f"CP attention takes (batch, heads, seq, head_dim) tensors; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise CpctlError(f"CP attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if 0 in (q.shape[0], q.shape[1], q.shape[3], k.shape[1], v.shape[3]):
        raise CpctlError(f"CP attention of empty tensors (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}); "
                         "skip the call, or make it outside maybe_context_parallel")
    if q.shape[2] != k.shape[2]:
        raise CpctlError(
            f"CP attention shards self-attention: q has {q.shape[2]} local tokens but k has {k.shape[2]}; "
            "cross-attention and KV caches are not sharded, run them outside maybe_context_parallel"
        )
    if q.shape[1] != k.shape[1]:
        if not enable_gqa:
            raise CpctlError(f"q has {q.shape[1]} heads but k/v {k.shape[1]}; pass enable_gqa=True for GQA/MQA")
        if q.shape[1] % k.shape[1]:
            raise CpctlError(f"GQA needs q heads ({q.shape[1]}) to be a multiple of k/v heads ({k.shape[1]})")
    layout.check_length(q.shape[2] * layout.cp_size, what="sequence length (local x cp_size)")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise CpctlError(f"CP attention needs q, k, v of one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    return q, k, v


# Under torch.compile the engine runs as it is (a graph break around attention): its collectives,
# its once-per-shape kernel checks (cached) and its autograd Function are not for dynamo to trace.
@torch.compiler.disable
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    layout: ChunkLayout,
    strategy: Strategy | str = Strategy.ALLGATHER,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | None = None,
    chunk: int | None = None,
    documents: Sequence[Sequence[int]] | None = None,
    hidden_keys: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> torch.Tensor:
    """Attention of this rank's query shard over the whole (sharded) sequence.

    `window`, `chunk`, `documents` (per batch row, the start position of every packed
    document) and `hidden_keys` (per batch row, the [start, stop) ranges of padding no query
    sees) narrow what each query sees (see `masks.Mask`); blocks they hide are skipped, not
    computed and masked.
    """
    strategy = Strategy.parse(strategy)
    q, k, v = checked_inputs(q, k, v, layout=layout, enable_gqa=enable_gqa)
    rows = list(zip(_document_rows(documents, batch=q.shape[0]), _hidden_rows(hidden_keys, batch=q.shape[0])))
    if len(set(rows)) > 1:  # rows packed or padded differently: each its own plan
        return torch.cat([
            context_parallel_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], group=group, layout=layout,
                                       strategy=strategy, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                       window=window, chunk=chunk, documents=[rows[b][0]], hidden_keys=[rows[b][1]])
            for b in range(q.shape[0])
        ])
    try:
        mask = Mask(causal=bool(is_causal), window=window, chunk=chunk, documents=rows[0][0], hidden=rows[0][1])
    except ValueError as exc:
        raise CpctlError(f"CP attention: {exc}") from None
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    spec = AttentionSpec(group=group, layout=layout, mask=mask, scale=scale, strategy=strategy,
                         chunk_len=q.shape[2] // len(layout.local_chunks))
    # A value head size other than q/k's (DeepSeek's MLA): zero columns change no score and
    # no output, and let K and V travel in one buffer through kernels that want one size.
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        q, k = (torch.nn.functional.pad(t, (0, v_dim - qk_dim)) for t in (q, k))
    if layout.cp_size == 1 and mask.is_plain and layout.local_chunks == tuple(range(layout.num_chunks)):
        return WholeSequenceAttention.apply(q, k, v, mask.causal, scale)[..., :v_dim]
    return _ContextParallelAttention.apply(q, k, v, spec)[..., :v_dim]
