"""The losses of a step, with their checks: `rt.token_mean`, `rt.document_mean`, `rt.causal_lm_loss`.

The reductions themselves are runtime/losses.py; here they get this rank's shards checked
against the step (sharded like the buffers, no appended token counted) and the step's groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cpctl import upstream
from cpctl.errors import CpctlError
from cpctl.runtime import adapters, losses
from cpctl.runtime import documents as packing
from cpctl.runtime.context import StepContext
from cpctl.runtime.mesh import Axis
from cpctl.runtime.padding import IGNORE_INDEX


def token_mean(context: StepContext, loss_sum: torch.Tensor, labels: torch.Tensor, *,
               ignore_index: int = -100) -> torch.Tensor:
    """The token-mean loss of the whole dp x cp batch, from this rank's summed loss (see losses.token_mean)."""
    context.require_sharded(labels, name="token_mean's labels", seq_dim=1 if labels.dim() > 1 else 0)
    context.require_ignored_tail(labels, ignore_index=ignore_index, what="rt.token_mean's loss")
    return losses.token_mean(loss_sum, labels, group=context.mesh.axes[Axis.DP_CP], ignore_index=ignore_index)


def document_mean(context: StepContext, token_losses: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """The mean over every packed document of the dp x cp batch of its own token-mean loss
    (see losses.document_mean); inputs are this rank's (batch, local_seq) shards."""
    for name, tensor in (("labels", labels), ("position_ids", position_ids)):
        context.require_sharded(tensor, name=f"document_mean's {name}", seq_dim=1)
    context.require_ignored_tail(labels, ignore_index=ignore_index, what="rt.document_mean's loss")
    step = context.step_of(position_ids, 1, what="rt.document_mean")
    full_positions = step.unshard(position_ids, seq_dim=1)
    positions = torch.arange(full_positions.shape[1], device=labels.device).expand_as(full_positions)
    axes = context.mesh.axes
    return losses.document_mean(token_losses, labels, starts=packing.starts_per_row(full_positions),
                                token_positions=step.shard(positions, seq_dim=1), cp=axes[Axis.CP_SP],
                                dp=axes[Axis.DP], dp_cp=axes[Axis.DP_CP], ignore_index=ignore_index)


def causal_lm_loss(context: StepContext, model: nn.Module, *, input_ids: torch.Tensor, labels: torch.Tensor,
                   **kwargs: Any) -> torch.Tensor:
    """A causal LM's loss (the global token mean, as model(labels=...).loss would be without CP)
    that never holds the full logits, computed by the adapter that knows the model."""
    for name, tensor in (("input_ids", input_ids), ("labels", labels)):
        context.require_sharded(tensor, name=f"causal_lm_loss's {name}", seq_dim=1)
    found = adapters.adapter_for(upstream.uncompiled(model))
    if found is None:
        raise CpctlError(f"rt.causal_lm_loss takes a Hugging Face causal LM, not a {type(model).__name__}; "
                         "compute the loss from its logits with rt.token_mean")
    appended = context.appended_in_shard(labels.shape[1], device=labels.device) if context.cp_active else None
    if appended is not None:  # labels by name: the appended tokens are ignored
        labels = labels.masked_fill(appended, IGNORE_INDEX)
    adapter, _ = found
    loss_sum, shifted = adapter.causal_lm_loss_sum(model, context, input_ids=input_ids, labels=labels,
                                                   chunk_tokens=context.config.memory.loss_chunk_tokens, **kwargs)
    return token_mean(context, loss_sum, shifted)
