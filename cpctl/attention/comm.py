"""The few collectives the CP engine uses, in one place so torch-version quirks stay here.

Everything is asynchronous: the engine posts a transfer, computes, then waits, so K/V move
while attention runs (on CUDA, NCCL works on its own stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ring:
    """This rank's neighbours in the CP group, as global ranks (P2P takes global ranks)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    next_global: int
    prev_global: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Ring:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        return cls(group, size, rank, ranks[(rank + 1) % size], ranks[(rank - 1) % size])

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Post: send `send` to the next rank, receive the previous rank's into `recv`."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_global, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_global, self.group),
        ]
        return dist.batch_isend_irecv(ops)


def wait_all(requests: list) -> None:
    for request in requests:
        request.wait()


def all_gather_async(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup):
    """Gather `local` from every rank into `output` (ranks stacked along dim 0)."""
    # gloo wants the ranks concatenated along dim 0, not stacked in a new dim.
    return _all_gather_single(output.flatten(0, 1), local, group=group, async_op=True)


def reduce_scatter_sum_async(output: torch.Tensor, stacked: torch.Tensor, group: dist.ProcessGroup):
    """Sum `stacked` (ranks along dim 0) over the group; this rank keeps its own slice."""
    return _reduce_scatter_single(output, stacked.flatten(0, 1), op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_to_all(output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Row j of `send` (ranks along dim 0) goes to rank j; row i of `output` comes from rank i.

    gloo has it on CPU as NCCL has it on CUDA (torch 2.6 on), in every dtype the engine uses.
    """
    dist.all_to_all_single(output, send, group=group)


# torch 2.13 renamed these (the old names warn); torch 2.6-2.12 have only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
