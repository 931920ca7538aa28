"""A Hugging Face batch's padding under CP: keys no query sees, exact at every cp size.

transformers reads a 2-D `attention_mask` as keys to hide: a query sees the unmasked keys its
layer's pattern allows (causal, window, chunk), and a query that sees none (a left-padding
token) gets attention output 0. cpctl computes the same without building the mask: each row's
zeros become hidden key ranges (`attention.masks.Mask.hidden`) that the engine cuts off
before any kernel call. Left padding, right padding and holes are therefore exact at every
token, padding tokens included, at every cp size and under Ulysses.

Besides the batch's padding, the runtime may append tokens so that the layout divides the
length (cpctl.runtime.padding): their labels (`labels`, `shift_labels`, known here by name)
are ignored, their position ids continue the row's, and no query sees them (the step hides
them itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpctl.errors import CpctlError
from cpctl.runtime.padding import IGNORE_INDEX

if TYPE_CHECKING:
    from cpctl.integrations.runtime_view import RuntimeView
    from cpctl.runtime.step import HiddenKeys


def adapt(kwargs: dict, runtime: RuntimeView, *, local_len: int, device: torch.device) -> None:
    """The forward's keyword arguments (this rank's shards), made exact for padding, in place:
    the mask becomes the step's hidden keys and is dropped."""
    appended = runtime.appended_in_shard(local_len, device=device)
    if appended is not None:
        for name in ("labels", "shift_labels"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].masked_fill(appended, IGNORE_INDEX)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = _continued(runtime, kwargs["position_ids"])
    runtime.hide_keys(hidden_keys(runtime, kwargs.get("attention_mask")))
    kwargs["attention_mask"] = None


def hidden_keys(runtime: RuntimeView, mask: torch.Tensor | None) -> HiddenKeys:
    """Per row, the [start, stop) ranges of real positions that a 2-D padding `mask` (this rank's
    shard) hides; None when it hides none. Every rank of the sequence takes part (a gather)."""
    if mask is None:
        return None
    require_2d(mask)
    full = runtime.gather_padded((mask != 0).to(torch.uint8), seq_dim=1)
    if runtime.padding is not None and full.shape[1] == runtime.padding.padded:
        full = full[:, :runtime.padding.length]  # the appended tokens are the step's own to hide
    hidden = torch.nn.functional.pad((full == 0).to(torch.int8), (1, 1))
    edges = hidden.diff(dim=1)  # +1 where a masked run starts, -1 one past where it ends
    starts, stops = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()
    rows: list[list[tuple[int, int]]] = [[] for _ in range(full.shape[0])]
    for (row, start), (_, stop) in zip(starts, stops):  # both in row-major order, paired run by run
        rows[row].append((start, stop))
    if not any(rows):
        return None
    return [tuple(row) or None for row in rows]


def require_2d(mask: torch.Tensor | None) -> None:
    if mask is not None and mask.dim() != 2:
        raise CpctlError(f"a {mask.dim()}-D attention_mask under context parallelism; pass the 2-D padding mask "
                         "(or none): cpctl builds the layer's attention pattern itself")


def _continued(runtime: RuntimeView, position_ids: torch.Tensor) -> torch.Tensor:
    """Position ids whose appended tokens count on from the last real token (no spurious document)."""
    full = runtime.gather_padded(position_ids, seq_dim=-1)
    length = runtime.padding.length
    rows = full.reshape(-1, full.shape[-1])
    index = torch.arange(rows.shape[-1], device=rows.device)
    last = rows[:, length - 1:length]
    rows = torch.where(index >= length, last + (index - length + 1), rows)
    return runtime.shard(rows.reshape(full.shape), seq_dim=-1)
