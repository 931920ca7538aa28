"""Ulysses (head-parallel) attention, alone or composed with the CP ring as a 2D layout.

The sequence is split over sp x cp ranks. Inside attention, one all-to-all over the sp group
trades the split: each rank gives away all but 1/sp of its heads and receives, for the heads
it keeps, the tokens of its sp peers. The sp peers' tokens together are exactly what one
rank of the CP ring holds (`sequence_layout` places them so), so the ring engine then runs
unchanged over the cp axis on the rank's heads; at cp 1 that is attention over the whole
sequence, one local kernel call. A second all-to-all brings the output back to tokens.
Autograd goes through both (each one's backward is the other), and K/V with fewer heads than
sp ranks (GQA/MQA) are replicated first, exactly: their gradients sum back over the copies.

Head-tail load balance is the ring's: a cp rank's chunks are cut into sp contiguous pieces of
its local buffer, one per sp rank. Work outside attention is the same for every token, so the
pieces need no balancing of their own; attention's work is the cp rank's, shared by heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpctl import topology
from cpctl.attention.comm import all_to_all
from cpctl.attention.kernels import expand_kv
from cpctl.attention.sharding import ChunkLayout
from cpctl.strategy import Strategy


def sequence_layout(ring: ChunkLayout, *, sp_size: int, sp_rank: int) -> ChunkLayout:
    """Which tokens rank (cp rank, sp rank) holds: ring chunk c becomes sp pieces c*sp .. c*sp+sp-1,
    and sp rank s takes the s-th contiguous part of its cp rank's pieces.

    Ranks are numbered cp-major (sp inner), as the flattened (cp, sp) mesh axis numbers them; the
    sp group's parts, concatenated in sp-rank order, are the cp rank's local buffer under `ring`.
    """
    if sp_size == 1:
        return ring
    assignment = []
    for cp_rank in range(ring.cp_size):
        pieces = [chunk * sp_size + j for chunk in ring.chunks_of(cp_rank) for j in range(sp_size)]
        per_rank = len(pieces) // sp_size
        assignment += [tuple(pieces[s * per_rank:(s + 1) * per_rank]) for s in range(sp_size)]
    return ChunkLayout(cp_size=ring.cp_size * sp_size, cp_rank=ring.cp_rank * sp_size + sp_rank,
                       load_balance=ring.load_balance, assignment=tuple(assignment),
                       divisor_reason=_divisor_reason(ring, sp_size))


def _divisor_reason(ring: ChunkLayout, sp_size: int) -> str:
    chunks = ring.num_chunks * sp_size
    if ring.assignment is not None:
        return f"the {chunks} chunks of the cost-balanced layout x sp_size {sp_size}"
    if ring.load_balance:
        return f"2 * cp_size * sp_size ({chunks}) with cp_load_balance"
    return f"cp_size * sp_size ({chunks})"


# ----------------------------------------------------------------------------- the all-to-alls


def _outputs(send: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """The all-to-all's results, laid out in its send buffer, spent once it has run: one contiguous
    piece per tensor. Their memory is the exchange's own whichever buffer the communication library
    holds a little longer (gloo frees its work's at times after the call returns): no third buffer."""
    sp = send.shape[0]
    return list(send.view(-1).split([sp * size for size in sizes]))


def _to_head_split(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """(B, H, n, D) shards of n tokens -> (B, H/sp, sp*n, D): this rank's heads, the group's tokens.

    One all-to-all moves every tensor: each rank's part for peer j (heads group j) sits in row j
    of one packed buffer. Results are seq-major views, the layout the kernels read in place.
    """
    sp = dist.get_world_size(group)
    parts = [(t.shape[0], t.shape[2], t.shape[1] // sp, t.shape[3]) for t in tensors]
    sizes = [b * n * h * d for b, n, h, d in parts]
    send = tensors[0].new_empty(sp, sum(sizes))
    offset = 0
    for t, (b, n, h, d), size in zip(tensors, parts, sizes):
        # (B, H, n, D) -> (sp, B, n, H/sp, D): heads group j goes to peer j
        send[:, offset:offset + size].view(sp, b, n, h, d).copy_(t.transpose(1, 2).unflatten(2, (sp, h)).permute(2, 0, 1, 3, 4))
        offset += size
    recv = torch.empty_like(send)
    all_to_all(recv, send, group)
    out, offset = [], 0
    for (b, n, h, d), size, target in zip(parts, sizes, _outputs(send, sizes)):
        # row i holds peer i's n tokens for this rank's heads: peers in order are the sequence
        target.view(b, sp, n, h, d).copy_(recv[:, offset:offset + size].view(sp, b, n, h, d).permute(1, 0, 2, 3, 4))
        out.append(target.view(b, sp * n, h, d).transpose(1, 2))
        offset += size
    return out


def _to_token_split(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The inverse: (B, H/sp, sp*n, D) -> (B, H, n, D), every head of this rank's n tokens."""
    sp = dist.get_world_size(group)
    parts = [(t.shape[0], t.shape[2] // sp, t.shape[1], t.shape[3]) for t in tensors]
    sizes = [b * n * h * d for b, n, h, d in parts]
    send = tensors[0].new_empty(sp, sum(sizes))
    offset = 0
    for t, (b, n, h, d), size in zip(tensors, parts, sizes):
        # (B, h, sp*n, D) -> (sp, B, n, h, D): peer j's tokens go back to peer j
        send[:, offset:offset + size].view(sp, b, n, h, d).copy_(t.transpose(1, 2).unflatten(1, (sp, n)).transpose(0, 1))
        offset += size
    recv = torch.empty_like(send)
    all_to_all(recv, send, group)
    out, offset = [], 0
    for (b, n, h, d), size, target in zip(parts, sizes, _outputs(send, sizes)):
        # row i holds heads group i of this rank's tokens
        target.view(b, n, sp, h, d).copy_(recv[:, offset:offset + size].view(sp, b, n, h, d).permute(1, 2, 0, 3, 4))
        out.append(target.view(b, n, sp * h, d).transpose(1, 2))
        offset += size
    return out


def _grads(grads: Sequence[torch.Tensor | None], like: Sequence[tuple]) -> list[torch.Tensor]:
    """Gradients of every output; one autograd did not reach (an unused output) is zeros."""
    return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, like)]


def _described(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(t.shape, t.dtype, t.device) for t in tensors]


class _AllToAll(torch.autograd.Function):
    """One of the two all-to-alls (`to_heads`: tokens -> heads, else back); the backward of each is the other."""

    @staticmethod
    def forward(ctx, group, to_heads: bool, *tensors):
        ctx.group, ctx.to_heads = group, to_heads
        outputs = (_to_head_split if to_heads else _to_token_split)(tensors, group)
        ctx.like = _described(outputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        inverse = _to_token_split if ctx.to_heads else _to_head_split
        return (None, None, *inverse(_grads(grads, ctx.like), ctx.group))


# ----------------------------------------------------------------------------- the entry point


# Under torch.compile the engine runs as it is (a graph break around attention): its collectives,
# its once-per-shape kernel checks (cached) and its autograd Function are not for dynamo to trace.
@torch.compiler.disable
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
    ring_layout: ChunkLayout,
    strategy: Strategy | str = Strategy.ALLGATHER,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | None = None,
    chunk: int | None = None,
    documents: Sequence[Sequence[int]] | None = None,
    hidden_keys: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> torch.Tensor:
    """Attention of this rank's (batch, heads, local_seq, head_dim) shards, sequence split over
    sp x cp ranks as `sequence_layout(ring_layout, ...)` places it; the result is this rank's
    rows of single-process attention over the whole sequence.

    `ring_layout` is the cp rank's layout (which chunks the ring sees); options as
    `context_parallel_attention`.
    """
    from cpctl.attention.engine import checked_inputs, context_parallel_attention

    sp = dist.get_world_size(sp_group)
    layout = sequence_layout(ring_layout, sp_size=sp, sp_rank=dist.get_rank(sp_group))
    q, k, v = checked_inputs(q, k, v, layout=layout, enable_gqa=enable_gqa)  # autocast's dtype, as the ring's
    copies = topology.kv_copies(q_heads=q.shape[1], kv_heads=k.shape[1], sp=sp)
    if copies > 1:  # fewer K/V heads than sp ranks can split: each is repeated, exactly
        k, v = expand_kv(k, copies), expand_kv(v, copies)
    q, k, v = _AllToAll.apply(sp_group, True, q, k, v)
    # The ring over cp on these heads; at cp 1 the engine makes it one kernel call over the whole sequence.
    strategy = strategy if dist.get_world_size(cp_group) > 1 else Strategy.RING
    out = context_parallel_attention(q, k, v, group=cp_group, layout=ring_layout, strategy=strategy,
                                     is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                     window=window, chunk=chunk, documents=documents, hidden_keys=hidden_keys)
    (out,) = _AllToAll.apply(sp_group, False, out)
    return out
