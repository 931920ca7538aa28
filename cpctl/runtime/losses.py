"""Loss reductions under CP: the mean over every token, or every document, of the dp x cp batch.

Each rank holds a share of the tokens, and FSDP averages gradients over the dp x cp ranks. A
reduction here returns, on every rank, the value of the whole batch's mean (ready to log),
with a gradient scaled so that after that averaging every parameter holds the single-process
gradient of the mean: `share + (mean - share).detach()`.

`mean_over_ranks` is the one reduction of a mean over ranks, for every loss cpctl reduces: the
token and document means here (a Hugging Face model's own `.loss` is `token_mean`'s, taken in
integrations/huggingface.py), and the evaluation losses of the Trainer and TRL over the CP
group (integrations/trainer.py, trl.py).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpctl.errors import CpctlError


def mean_over_ranks(local_sum: torch.Tensor, local_count: torch.Tensor | float, *,
                    group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `local_sum` / sum of `local_count`, sum of `local_count` at least 1) over `group`'s
    ranks: one all-reduce, in fp32, without gradient. A count of 1 per rank is the plain mean of
    the ranks' values."""
    stats = torch.stack([local_sum.detach().float(),
                         torch.as_tensor(local_count, dtype=torch.float32, device=local_sum.device)])
    dist.all_reduce(stats, group=group)
    total_count = stats[1].clamp(min=1)
    return stats[0] / total_count, total_count


def _valued_as(mean: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """`mean`'s value with the gradient of this rank's `share`."""
    return share + (mean - share).detach()


def token_mean(loss_sum: torch.Tensor, labels: torch.Tensor, *, group: DeviceMesh, ignore_index: int = -100) -> torch.Tensor:
    """The token-mean loss over `group` (the dp x cp ranks) from this rank's summed loss."""
    mean, total_tokens = mean_over_ranks(loss_sum, (labels != ignore_index).sum(), group=group.get_group())
    share = loss_sum * (group.size() / total_tokens)  # FSDP's gradient reduction divides by group.size()
    return _valued_as(mean, share)


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
    mean, total_docs = mean_over_ranks((sums[with_tokens] / counts[with_tokens]).sum(), with_tokens.sum(),
                                       group=dp.get_group())
    weights = (1.0 / counts.clamp(min=1))[doc] * kept
    share = (token_losses * weights).sum() * (dp_cp.size() / total_docs)
    return _valued_as(mean, share)


# ----------------------------------------------------------------------------- chunked cross-entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(transform(hidden @ weight.T + bias), labels), a chunk of tokens at a time.

    Neither the full logits, nor their fp32 copy, nor their gradient exist at once: the forward
    keeps only the loss, the backward recomputes each chunk's logits and differentiates them
    on the spot. With a 128k vocabulary that is tens of GiB fewer at long lengths.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, ignore_index, transform):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _logits(hidden[rows], weight, bias, transform)
            total += torch.nn.functional.cross_entropy(logits, labels[rows], ignore_index=ignore_index, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk_tokens, ctx.ignore_index, ctx.transform = chunk_tokens, ignore_index, transform
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        weight_leaf = weight.detach().requires_grad_()
        bias_leaf = bias.detach().requires_grad_() if bias is not None else None
        leaves = [weight_leaf] + ([bias_leaf] if bias_leaf is not None else [])
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows].detach().requires_grad_()
            with torch.enable_grad():
                logits = _logits(h, weight_leaf, bias_leaf, ctx.transform)
                loss = torch.nn.functional.cross_entropy(logits, labels[rows], ignore_index=ctx.ignore_index,
                                                         reduction="sum")
                grads = torch.autograd.grad(loss, [h, *leaves], grad_total)
            grad_hidden[rows] = grads[0]
            grad_weight += grads[1].float()
            if grad_bias is not None:
                grad_bias += grads[2].float()
        return (grad_hidden, grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype),
                None, None, None, None)


def _logits(hidden, weight, bias, transform):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return (transform(logits) if transform is not None else logits).float()


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                 bias: torch.Tensor | None = None, chunk_tokens: int = 4096,
                                 ignore_index: int = -100, transform=None) -> torch.Tensor:
    """The summed cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, never holding the
    full logits: `hidden` (..., H), `labels` (...), `weight` (V, H). `transform` is applied to
    each chunk's logits first (a model's logit scale or softcap). Exact: the same value and
    gradients as the unchunked loss, chunk by chunk."""
    if chunk_tokens < 1:
        raise CpctlError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise CpctlError(f"chunked loss: {flat_hidden.shape[0]} hidden states but {flat_labels.shape[0]} labels")
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, chunk_tokens, ignore_index,
                                            transform)
