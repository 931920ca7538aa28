"""The all-gather strategy: gather every rank's K/V once, overlapped with the local block.

Forward: post the all-gather of this rank's K/V, compute the block that needs only local
K/V (one causal call: head-tail shards keep global order), then attend the local queries
to the gathered K/V laid out in sequence order (Llama 3 style: each query chunk against
its whole visible prefix in one call). Backward: gather K/V again rather than keep the
whole sequence's K/V alive between forward and backward (memory per GPU stays flat), then
reduce-scatter the K/V gradients back to their owners. In a group of one (cp_size 1) every
block is local and no collective runs.
"""

from __future__ import annotations

import torch

from cpctl.attention.blocks import (
    ChunkSink,
    ForwardAccumulator,
    backward_blocks,
    empty_seq_major,
    forward_blocks,
    seq_chunks,
    stack_kv,
)
from cpctl.attention.comm import all_gather_async, reduce_scatter_sum_async
from cpctl.attention.masks import Visibility
from cpctl.attention.plan import plan_blocks
from cpctl.attention.sharding import ChunkLayout
from cpctl.attention.spec import AttentionSpec


def local_plan(spec: AttentionSpec, *, causal_squares: bool = True):
    """Blocks over this rank's own K/V (forward: one causal call; backward: finer units)."""
    local = spec.layout.local_chunks
    return plan_blocks(local, local, spec.visibility, causal_squares=causal_squares)


def remote_plan(spec: AttentionSpec):
    """Blocks over the gathered K/V in sequence order, skipping the chunks this rank holds."""
    local = spec.layout.local_chunks
    base = spec.visibility

    def remote(q_chunk: int, kv_chunk: int) -> Visibility:
        return Visibility.NONE if kv_chunk in local else base(q_chunk, kv_chunk)

    return plan_blocks(local, range(spec.layout.num_chunks), remote)


def _post_gather(k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec):
    kv = stack_kv(k, v).transpose(2, 3)  # the dense (2, B, L, H, D) memory
    gathered = kv.new_empty((spec.layout.cp_size, *kv.shape))
    return gathered, all_gather_async(gathered, kv, spec.group)


def _chunk_moves(layout: ChunkLayout, chunk_len: int):
    """(rank, rows in that rank's shard, rows in the full sequence) for every chunk."""
    for rank in range(layout.cp_size):
        for pos, chunk in enumerate(layout.chunks_of(rank)):
            yield rank, slice(pos * chunk_len, (pos + 1) * chunk_len), slice(chunk * chunk_len, (chunk + 1) * chunk_len)


def _sequence_order(gathered: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """(cp, 2, B, L, H, D) in rank order -> seq-major (2, B, H, S, D) in sequence order."""
    cp, two, b, local_len, h, d = gathered.shape
    chunk_len = local_len // len(layout.local_chunks)
    ordered = gathered.new_empty(two, b, layout.num_chunks * chunk_len, h, d)
    for rank, shard_rows, seq_rows in _chunk_moves(layout, chunk_len):
        ordered[:, :, seq_rows].copy_(gathered[rank, :, :, shard_rows])
    return ordered.transpose(2, 3)


def forward(q, k, v, spec: AttentionSpec):
    chunk_len = q.shape[2] // len(spec.layout.local_chunks)
    local_blocks, remote_blocks = local_plan(spec), remote_plan(spec)
    acc = ForwardAccumulator(q, chunk_len=chunk_len, num_chunks=len(spec.layout.local_chunks))
    if spec.layout.cp_size == 1:  # a group of one: all K/V is local, nothing to gather
        forward_blocks(acc, local_blocks, q, k, v, spec=spec)
        return acc.result(q.dtype)
    gathered, request = _post_gather(k, v, spec)
    forward_blocks(acc, local_blocks, q, k, v, spec=spec)
    request.wait()
    kv_all = _sequence_order(gathered, spec.layout)
    del gathered
    forward_blocks(acc, remote_blocks, q, kv_all[0], kv_all[1], spec=spec)
    return acc.result(q.dtype)


def backward(dout, q, k, v, out, lse, spec: AttentionSpec):
    layout = spec.layout
    chunk_len = q.shape[2] // len(layout.local_chunks)
    c = chunk_len
    remote_blocks = remote_plan(spec)
    # The local work in fine blocks: the first ones hide the all-gather, the last one the
    # reduce-scatter of the K/V gradients.
    local_blocks = local_plan(spec, causal_squares=False)
    split = max(1, len(local_blocks) - 1)

    dq_buf = empty_seq_major(q.shape, like=q)
    dkv_local_buf = empty_seq_major((2, *k.shape), like=k)
    dq = ChunkSink(seq_chunks(dq_buf, chunk_len=c), num_chunks=len(layout.local_chunks), chunk_len=c)
    dkv_local = ChunkSink(seq_chunks(dkv_local_buf[0], dkv_local_buf[1], chunk_len=c),
                          num_chunks=len(layout.local_chunks), chunk_len=c)
    rows = dict(dout=dout, q=q, out=out, lse=lse, dq=dq, chunk_len=c, spec=spec)
    if layout.cp_size == 1:  # a group of one: no K/V to gather, no gradients to send back
        backward_blocks(local_blocks, k=k, v=v, dkv=dkv_local, **rows)
        dq.zero_unwritten()
        dkv_local.zero_unwritten()
        return dq_buf.to(q.dtype), dkv_local_buf[0].to(k.dtype), dkv_local_buf[1].to(v.dtype)
    gathered, request = _post_gather(k, v, spec)
    backward_blocks(local_blocks[:split], k=k, v=v, dkv=dkv_local, **rows)
    request.wait()
    kv_all = _sequence_order(gathered, layout)
    del gathered

    # Remote K/V gradients land straight in the reduce-scatter's rank-ordered buffer.
    stacked = torch.empty(layout.cp_size, 2, k.shape[0], k.shape[2], k.shape[1], k.shape[3],
                          dtype=k.dtype, device=k.device)
    owner = {chunk: (rank, pos) for rank in range(layout.cp_size) for pos, chunk in enumerate(layout.chunks_of(rank))}

    def rank_slot(chunk: int):
        rank, pos = owner[chunk]
        slot = stacked[rank, :, :, pos * c:(pos + 1) * c].transpose(2, 3)
        return slot[0], slot[1]

    remote = ChunkSink(rank_slot, num_chunks=layout.num_chunks, chunk_len=c)
    backward_blocks(remote_blocks, k=kv_all[0], v=kv_all[1], dkv=remote, **rows)
    remote.zero_unwritten()
    del kv_all
    dkv_remote = torch.empty(stacked.shape[1:], dtype=k.dtype, device=k.device)
    request = reduce_scatter_sum_async(dkv_remote, stacked, spec.group)
    backward_blocks(local_blocks[split:], k=k, v=v, dkv=dkv_local, **rows)
    dq.zero_unwritten()
    dkv_local.zero_unwritten()
    request.wait()
    dkv_local_buf += dkv_remote.transpose(2, 3)
    return dq_buf.to(q.dtype), dkv_local_buf[0].to(k.dtype), dkv_local_buf[1].to(v.dtype)
