"""Loss reductions under CP: the mean over every token, or every document, of the dp x cp batch.

Each rank holds a share of the tokens, and FSDP averages gradients over the dp x cp ranks. A
reduction here returns, on every rank, the value of the whole batch's mean (ready to log),
with a gradient scaled so that after that averaging every parameter holds the single-process
gradient of the mean: `share + (mean - share).detach()`.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def token_mean(loss_sum: torch.Tensor, labels: torch.Tensor, *, group: DeviceMesh, ignore_index: int = -100) -> torch.Tensor:
    """The token-mean loss over `group` (the dp x cp ranks) from this rank's summed loss."""
    stats = torch.stack([loss_sum.detach().float(), (labels != ignore_index).sum().float()])
    dist.all_reduce(stats, group=group.get_group())
    total_loss, total_tokens = stats[0], stats[1].clamp(min=1)
    share = loss_sum * (group.size() / total_tokens)  # FSDP's gradient reduction divides by group.size()
    return share + (total_loss / total_tokens - share).detach()


def document_mean(token_losses: torch.Tensor, labels: torch.Tensor, *, starts: list[tuple[int, ...]],
                  token_positions: torch.Tensor, cp: DeviceMesh, dp: DeviceMesh, dp_cp: DeviceMesh,
                  ignore_index: int = -100) -> torch.Tensor:
    """The mean over every packed document of its own token-mean loss.

    `token_losses` (cross-entropy with reduction="none") and `labels` are this rank's
    (batch, local_seq) shards, `token_positions` where each of their tokens sits in its row,
    `starts` each row's document starts. A document's tokens may sit on several CP ranks: its
    sum and count are reduced over `cp` first; other dp ranks hold other documents.
    """
    device = labels.device
    # each local token's document, numbered across the rows of this rank's batch
    offsets = torch.tensor([0, *itertools.accumulate(len(row) for row in starts)][:-1], device=device)
    doc = torch.stack([torch.searchsorted(torch.tensor(row, device=device), token_positions[b], right=True) - 1
                       for b, row in enumerate(starts)]) + offsets[:, None]
    kept = labels != ignore_index
    num_docs = sum(len(row) for row in starts)
    totals = torch.zeros(2, num_docs, dtype=torch.float32, device=device)  # loss sums, token counts
    totals[0].index_add_(0, doc[kept], token_losses[kept].detach().float())
    totals[1].index_add_(0, doc[kept], torch.ones_like(totals[1][doc[kept]]))
    dist.all_reduce(totals, group=cp.get_group())
    sums, counts = totals
    with_tokens = counts > 0
    stats = torch.stack([(sums[with_tokens] / counts[with_tokens]).sum(), with_tokens.sum().float()])
    dist.all_reduce(stats, group=dp.get_group())
    total_means, total_docs = stats[0], stats[1].clamp(min=1)
    weights = (1.0 / counts.clamp(min=1))[doc] * kept
    share = (token_losses * weights).sum() * (dp_cp.size() / total_docs)
    return share + (total_means / total_docs - share).detach()
