"""The end of a Hugging Face model's rows under CP: tokens that count for nothing.

Two kinds of tokens may end a row: those `maybe_context_parallel` appends so that the layout
divides the length (cpctl.runtime.padding), and a right-padded batch's padding (an
`attention_mask` of ones then zeros, as TRL's and transformers' collators build it). Causal
attention never lets a token see those after it, so every real token's output is the
one-process output once:

* the appended tokens' labels (`labels`, `shift_labels`, known here by name) are ignored;
* a padded position's own prediction is not counted: the (shifted) labels from each row's
  first padding token on must be -100 (the collators make them so), else it is refused;
* the positions of the dead tail continue the row's (no spurious packed documents);
* the mask is then dropped, and any attention that is not causal is refused for the step.

Left padding or holes in the mask cannot be expressed this way and are refused. The logits of
padded positions are not the one-process values (they belong to no token; metrics ignore them
through their -100 labels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpctl.errors import CpctlError

if TYPE_CHECKING:
    from cpctl.integrations.runtime_view import RuntimeView

IGNORE_INDEX = -100
NOT_RIGHT_PADDED = ("an attention_mask with left padding or holes under context parallelism; CP computes rows whose "
                    "padding (if any) comes after all their tokens: pad on the right (tokenizer.padding_side = "
                    "\"right\"), or pack the sequences without padding")


def adapt(kwargs: dict, runtime: RuntimeView, *, local_len: int, device: torch.device) -> None:
    """The forward's keyword arguments (this rank's shards), made exact for the row ends, in place."""
    appended = runtime.appended_in_shard(local_len, device=device)
    if appended is not None:
        for name in ("labels", "shift_labels"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].masked_fill(appended, IGNORE_INDEX)
    mask = kwargs.get("attention_mask")
    starts = dead_tail_starts(runtime, mask, appended=appended)
    if starts is not None:
        _require_ignored(runtime, starts, labels=kwargs.get("labels"), shift_labels=kwargs.get("shift_labels"))
        runtime.hide_tail("the batch is right-padded")
    if kwargs.get("position_ids") is not None and (starts is not None or appended is not None):
        kwargs["position_ids"] = _continued(runtime, kwargs["position_ids"], starts)
    kwargs["attention_mask"] = None  # what is left is causal attention over every row


def dead_tail_starts(runtime: RuntimeView, mask: torch.Tensor | None, *,
                     appended: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where each row's padding starts (full-sequence index), for a right-padded `mask` (this
    rank's shard); None when no real token is masked. Left padding or holes: refused. Every CP
    rank takes part (the padding sits in some shards only)."""
    if mask is None or mask.dim() != 2:
        if mask is not None:
            raise CpctlError(f"a {mask.dim()}-D attention_mask under context parallelism; pass the 2-D padding mask "
                             "(or none): cpctl builds the causal pattern itself")
        return None
    masked = ~mask.bool()
    if appended is not None and masked.shape[-1] == appended.shape[0]:
        masked = masked & ~appended  # the appended tokens are the runtime's own, known to be ignored
    flag = torch.tensor([int(bool(masked.any()))], device=runtime.device)
    torch.distributed.all_reduce(flag, group=runtime.seq_group)
    if not int(flag.item()):
        return None
    if appended is not None and mask.shape[-1] == appended.shape[0]:
        mask = mask.masked_fill(appended, 0)
    full = runtime.gather_padded(mask.long().clamp(0, 1), seq_dim=1)
    if bool((full[:, 1:] > full[:, :-1]).any()):  # a one after a zero: left padding or a hole
        raise CpctlError(NOT_RIGHT_PADDED)  # every CP rank sees the same gathered mask
    return full.sum(dim=1)  # ones then zeros: the first zero is at the count of ones


def _require_ignored(runtime: RuntimeView, starts: torch.Tensor, *, labels: torch.Tensor | None,
                     shift_labels: torch.Tensor | None) -> None:
    """Each padded position's prediction must be ignored: its logits are not one process's."""
    if shift_labels is not None:
        predicted = runtime.gather_padded(shift_labels, seq_dim=1)
    elif labels is not None:
        full = runtime.gather_padded(labels, seq_dim=1)
        predicted = torch.cat([full[:, 1:], torch.full_like(full[:, :1], IGNORE_INDEX)], dim=1)
    else:
        return  # no loss here: the logits of padded positions are simply not defined
    index = torch.arange(predicted.shape[1], device=predicted.device)
    counted = (index >= starts[:, None].to(predicted.device)) & (predicted != IGNORE_INDEX)
    if bool(counted.any()):
        raise CpctlError("a right-padded batch whose labels count padding tokens, under context parallelism: their "
                         "predictions are not computed as in one process; set the labels of padding tokens to -100 "
                         "(DataCollatorForLanguageModeling and TRL's collator do)")


def _continued(runtime: RuntimeView, position_ids: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """Position ids whose dead tail (padding, appended tokens) counts on from the last real token."""
    full = runtime.gather_padded(position_ids, seq_dim=-1)
    length = runtime.padding.length if runtime.padding is not None else full.shape[-1]
    rows = full.reshape(-1, full.shape[-1])
    if starts is not None and starts.shape[0] == rows.shape[0]:
        tail = torch.minimum(starts.to(rows.device), torch.full_like(starts, length, device=rows.device))
    else:  # positions shared by every row: only the appended tokens are everyone's tail
        tail = torch.full((rows.shape[0],), length, device=rows.device)
    index = torch.arange(rows.shape[-1], device=rows.device)
    last = rows.gather(1, (tail - 1).clamp(min=0)[:, None])
    last = torch.where(tail[:, None] > 0, last, torch.full_like(last, -1))
    rows = torch.where(index >= tail[:, None], last + (index - tail[:, None] + 1), rows)
    return runtime.shard(rows.reshape(full.shape), seq_dim=-1)
