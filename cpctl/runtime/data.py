"""Token helpers that keep labels and positions right once the sequence is sharded.

They take batch-first (batch, seq) tensors and must be applied to the *full* sequence,
before `maybe_context_parallel` shards it: after sharding, a rank no longer sees the token
that follows its last one, nor where its tokens sit in the sequence.

Packed documents are described the way transformers' DataCollatorWithFlattening does it:
position ids that restart at 0 where a document starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shift_labels(input_ids: torch.Tensor, *, ignore_index: int = -100,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token labels: labels[:, t] = input_ids[:, t + 1], and `ignore_index` at the end.

    With the `position_ids` of packed documents, also `ignore_index` at each document's last
    token: no document learns to predict the next one's first token.
    """
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    if position_ids is not None:
        position_ids = position_ids.expand_as(input_ids)
        ends = position_ids[:, 1:] - position_ids[:, :-1] != 1  # the next token starts a document
        labels[:, :-1][ends] = ignore_index
    return labels


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    """0..S-1 for every row, as a dense tensor of its own (it is sharded in place later)."""
    batch, seq = input_ids.shape[0], input_ids.shape[1]
    return torch.arange(seq, device=input_ids.device).repeat(batch, 1)


def position_ids_for_documents(lengths: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor, *,
                               device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids of documents packed back to back: `[[3, 2]]` -> `[[0, 1, 2, 0, 1]]`.

    `lengths`: one list of document lengths per row (rows must add up to the same length),
    or a single list for one row. Cumulative lengths (cu_seqlens) convert with `diff()`.
    """
    rows = [lengths] if lengths and not isinstance(lengths[0], (Sequence, torch.Tensor)) else lengths
    rows = [[int(n) for n in row] for row in rows]
    totals = {sum(row) for row in rows}
    if len(totals) != 1 or any(n < 1 for row in rows for n in row):
        raise ValueError(f"document lengths must be positive and add up to one length per row, got totals {sorted(totals)}")
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(device)


def position_ids_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids from per-token document ids (batch, seq): a document starts where the id changes."""
    ids = document_ids.reshape(-1, document_ids.shape[-1])
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return (index - last_start).reshape(document_ids.shape)
