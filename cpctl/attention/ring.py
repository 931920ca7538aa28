"""The ring strategy (`alltoall` in profiles): K/V blocks rotate around the CP group.

At step s a rank holds the K/V of rank (r - s) and attends its queries to it, while the next
block is already on its way (send/recv posted before the compute). Only two K/V blocks are
alive at a time, so memory stays flat as the group grows. In the backward the K/V gradients
travel with their block: each rank adds its share and passes the sum on; one last hop
brings every block's gradient home.
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
from cpctl.attention.comm import Ring, wait_all
from cpctl.attention.plan import plan_blocks
from cpctl.attention.spec import AttentionSpec


def plan(spec: AttentionSpec, source_rank: int):
    """Blocks of this rank's queries over the K/V that `source_rank` holds (one ring step)."""
    return plan_blocks(spec.layout.local_chunks, spec.layout.chunks_of(source_rank), spec.visibility)


def _shift(ring: Ring, buffer: torch.Tensor):
    """Post the rotation of a seq-major (2, B, H, L, D) buffer; returns (incoming, requests)."""
    dense = buffer.transpose(2, 3)
    incoming = torch.empty_like(dense)
    return incoming.transpose(2, 3), ring.shift(dense, incoming)


def forward(q, k, v, spec: AttentionSpec):
    ring = Ring.of(spec.group)
    chunk_len = q.shape[2] // len(spec.layout.local_chunks)
    acc = ForwardAccumulator(q, chunk_len=chunk_len, num_chunks=len(spec.layout.local_chunks))
    kv = stack_kv(k, v)
    for step in range(ring.size):
        incoming, requests = _shift(ring, kv) if step < ring.size - 1 else (kv, [])
        forward_blocks(acc, plan(spec, (ring.rank - step) % ring.size), q, kv[0], kv[1], spec=spec)
        wait_all(requests)
        kv = incoming
    return acc.result(q.dtype)


def backward(dout, q, k, v, out, lse, spec: AttentionSpec):
    ring = Ring.of(spec.group)
    num_chunks = len(spec.layout.local_chunks)
    c = q.shape[2] // num_chunks
    dq_buf = empty_seq_major(q.shape, like=q)
    dq = ChunkSink(seq_chunks(dq_buf, chunk_len=c), num_chunks=num_chunks, chunk_len=c)
    kv = stack_kv(k, v)
    dkv_home = None  # this rank's own block's gradient, summed by every other rank
    sum_incoming, sum_requests, sending = None, [], None
    for step in range(ring.size):
        kv_next, kv_requests = _shift(ring, kv) if step < ring.size - 1 else (kv, [])
        dkv = empty_seq_major(kv.shape, like=kv)
        dkv_sink = ChunkSink(seq_chunks(dkv[0], dkv[1], chunk_len=c), num_chunks=num_chunks, chunk_len=c)
        backward_blocks(plan(spec, (ring.rank - step) % ring.size), dout=dout, q=q, k=kv[0], v=kv[1],
                        out=out, lse=lse, dq=dq, dkv=dkv_sink, chunk_len=c, spec=spec)
        dkv_sink.zero_unwritten()
        if step == 0:
            dkv_home = dkv  # the own block's share stays here; the others' shares travel
        else:
            wait_all(sum_requests)  # the sum so far for this same block, from the previous rank
            if sum_incoming is not None:
                dkv += sum_incoming
            if step == ring.size - 1:  # the last hop is not hidden behind compute: send it narrow
                dkv = dkv.to(k.dtype)
            sending = dkv  # keep the buffer alive until its send completes
            sum_incoming, sum_requests = _shift(ring, sending)
        wait_all(kv_requests)
        kv = kv_next
    dq.zero_unwritten()
    if ring.size > 1:
        wait_all(sum_requests)  # the last hop: this rank's own block, summed over the others
        dkv_home += sum_incoming
    return dq_buf.to(q.dtype), dkv_home[0].to(k.dtype), dkv_home[1].to(v.dtype)
