"""Token helpers that keep labels and positions right once the sequence is sharded.

Both take batch-first (batch, seq) token ids and must be applied to the *full* sequence,
before `maybe_context_parallel` shards it: after sharding, a rank no longer sees the token
that follows its last one, nor where its tokens sit in the sequence.
"""

from __future__ import annotations

import torch


def shift_labels(input_ids: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels: labels[:, t] = input_ids[:, t + 1], and `ignore_index` at the end."""
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    """0..S-1 for every row, as a dense tensor of its own (it is sharded in place later)."""
    batch, seq = input_ids.shape[0], input_ids.shape[1]
    return torch.arange(seq, device=input_ids.device).repeat(batch, 1)
