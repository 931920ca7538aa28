"""The all-gather strategy: gather every rank's K/V once, overlapped with the local block.

Forward: post the all-gather of this rank's K/V, compute the blocks that need only local K/V
(the causal diagonal, or the whole local block when non-causal), then attend the local
queries to the gathered K/V laid out in sequence order (Llama 3 style: each query chunk
against its whole visible prefix in one call). Backward: gather K/V again rather than keep
the full sequence's K/V alive between forward and backward (memory per GPU stays flat),
then reduce-scatter the K/V gradients back to their owners.
"""

from __future__ import annotations

import torch

from cpctl.attention.blocks import ForwardAccumulator, backward_blocks, forward_blocks
from cpctl.attention.comm import all_gather_async, reduce_scatter_sum
from cpctl.attention.plan import Visibility, causal_visibility, plan_blocks
from cpctl.attention.spec import AttentionSpec


def _local_visibility(causal: bool):
    if causal:
        return lambda qc, kc: Visibility.DIAGONAL if qc == kc else Visibility.NONE
    return lambda qc, kc: Visibility.FULL


def _remote_visibility(causal: bool, local: tuple[int, ...]):
    if causal:
        return lambda qc, kc: Visibility.NONE if qc == kc else causal_visibility(qc, kc)
    return lambda qc, kc: Visibility.NONE if kc in local else Visibility.FULL


def _post_gather(k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec):
    kv = torch.stack([k, v])
    gathered = kv.new_empty((spec.layout.cp_size, *kv.shape))
    return gathered, all_gather_async(gathered, kv, spec.group)


def _sequence_order(gathered: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """(cp, 2, B, H, L, D) in rank order -> (2, B, H, S, D) in sequence order."""
    layout = spec.layout
    per_rank = len(layout.local_chunks)
    cp, two, b, h, local_len, d = gathered.shape
    c = local_len // per_rank
    ordered = gathered.new_empty(two, b, h, layout.num_chunks * c, d)
    for rank in range(cp):
        for pos, chunk in enumerate(layout.chunks_of(rank)):
            ordered[:, :, :, chunk * c:(chunk + 1) * c].copy_(gathered[rank, :, :, :, pos * c:(pos + 1) * c])
    return ordered


def _rank_order(ordered: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Inverse of _sequence_order: (2, B, H, S, D) -> (cp, 2, B, H, L, D)."""
    layout = spec.layout
    per_rank = len(layout.local_chunks)
    two, b, h, s, d = ordered.shape
    c = s // layout.num_chunks
    stacked = ordered.new_empty(layout.cp_size, two, b, h, per_rank * c, d)
    for rank in range(layout.cp_size):
        for pos, chunk in enumerate(layout.chunks_of(rank)):
            stacked[rank, :, :, :, pos * c:(pos + 1) * c].copy_(ordered[:, :, :, chunk * c:(chunk + 1) * c])
    return stacked


def forward(q, k, v, spec: AttentionSpec):
    layout = spec.layout
    local = layout.local_chunks
    chunk_len = q.shape[2] // len(local)
    gathered, request = _post_gather(k, v, spec)
    acc = ForwardAccumulator(q, chunk_len=chunk_len, num_chunks=len(local))
    forward_blocks(acc, plan_blocks(local, local, _local_visibility(spec.causal)), q, k, v, scale=spec.scale)
    request.wait()
    kv_all = _sequence_order(gathered, spec)
    del gathered
    remote = plan_blocks(local, range(layout.num_chunks), _remote_visibility(spec.causal, local))
    forward_blocks(acc, remote, q, kv_all[0], kv_all[1], scale=spec.scale)
    return acc.out.to(q.dtype), acc.lse


def backward(dout, q, k, v, out, lse, spec: AttentionSpec):
    layout = spec.layout
    local = layout.local_chunks
    chunk_len = q.shape[2] // len(local)
    gathered, request = _post_gather(k, v, spec)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk_local = torch.zeros_like(k, dtype=torch.float32)
    dv_local = torch.zeros_like(v, dtype=torch.float32)
    saved = dict(dout=dout, q=q, out=out, lse=lse, dq=dq, chunk_len=chunk_len, scale=spec.scale)
    backward_blocks(plan_blocks(local, local, _local_visibility(spec.causal)), k=k, v=v,
                    dk=dk_local, dv=dv_local, **saved)
    request.wait()
    kv_all = _sequence_order(gathered, spec)
    del gathered
    dkv_all = torch.zeros(kv_all.shape, dtype=torch.float32, device=kv_all.device)
    remote = plan_blocks(local, range(layout.num_chunks), _remote_visibility(spec.causal, local))
    backward_blocks(remote, k=kv_all[0], v=kv_all[1], dk=dkv_all[0], dv=dkv_all[1], **saved)
    del kv_all
    dkv_mine = torch.empty((2, *k.shape), dtype=torch.float32, device=k.device)
    reduce_scatter_sum(dkv_mine, _rank_order(dkv_all, spec), spec.group)
    dk_local += dkv_mine[0]
    dv_local += dkv_mine[1]
    return dq.to(q.dtype), dk_local.to(k.dtype), dv_local.to(v.dtype)
