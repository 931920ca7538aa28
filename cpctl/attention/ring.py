"""The ring strategy (`alltoall` in profiles): K/V blocks rotate around the CP group.

At step s a rank holds the K/V of rank (r - s) and attends its queries to it, while the next
block is already on its way (send/recv posted before the compute). Only two K/V blocks are
alive at a time, so memory stays flat as the group grows. In the backward the K/V gradients
travel with their block: each rank adds its share and passes the sum on; one last hop
brings every block's gradient home.
"""

from __future__ import annotations

import torch

from cpctl.attention.blocks import ForwardAccumulator, backward_blocks, forward_blocks
from cpctl.attention.comm import Ring, wait_all
from cpctl.attention.plan import causal_visibility, full_visibility, plan_blocks
from cpctl.attention.spec import AttentionSpec


def _plan(spec: AttentionSpec, source_rank: int):
    visibility = causal_visibility if spec.causal else full_visibility
    return plan_blocks(spec.layout.local_chunks, spec.layout.chunks_of(source_rank), visibility)


def forward(q, k, v, spec: AttentionSpec):
    ring = Ring.of(spec.group)
    chunk_len = q.shape[2] // len(spec.layout.local_chunks)
    acc = ForwardAccumulator(q, chunk_len=chunk_len, num_chunks=len(spec.layout.local_chunks))
    kv = torch.stack([k, v])
    for step in range(ring.size):
        incoming, requests = None, []
        if step < ring.size - 1:
            incoming = torch.empty_like(kv)
            requests = ring.shift(kv, incoming)
        forward_blocks(acc, _plan(spec, (ring.rank - step) % ring.size), q, kv[0], kv[1], scale=spec.scale)
        wait_all(requests)
        kv = incoming if incoming is not None else kv
    return acc.out.to(q.dtype), acc.lse


def backward(dout, q, k, v, out, lse, spec: AttentionSpec):
    ring = Ring.of(spec.group)
    chunk_len = q.shape[2] // len(spec.layout.local_chunks)
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack([k, v])
    dkv_requests, dkv_incoming, dkv_in_flight = [], None, None
    for step in range(ring.size):
        kv_next, kv_requests = None, []
        if step < ring.size - 1:
            kv_next = torch.empty_like(kv)
            kv_requests = ring.shift(kv, kv_next)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        backward_blocks(_plan(spec, (ring.rank - step) % ring.size), dout=dout, q=q, k=kv[0], v=kv[1],
                        out=out, lse=lse, dq=dq, dk=dkv[0], dv=dkv[1], chunk_len=chunk_len, scale=spec.scale)
        wait_all(dkv_requests)  # the sum so far for this same block, from the previous rank
        if dkv_incoming is not None:
            dkv += dkv_incoming
        dkv_incoming, dkv_in_flight = torch.empty_like(dkv), dkv  # keep the sent buffer alive
        dkv_requests = ring.shift(dkv_in_flight, dkv_incoming)
        wait_all(kv_requests)
        kv = kv_next if kv_next is not None else kv
    wait_all(dkv_requests)  # the last hop: this rank's own block, summed over every rank
    return dq.to(q.dtype), dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype)
