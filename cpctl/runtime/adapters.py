"""Model adapters: what another library's models need under CP, registered by its integration.

The runtime never imports an integration. An integration that knows a kind of model (the Hugging
Face one: transformers models) registers an adapter here when it is loaded (`cpctl.init` loads
the built-in ones), and the runtime asks which registered adapter knows a model it is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

# The runtime's step context (runtime/context.py), handed to the adapters; that module asks this
# one for the refusals inside a step, so the type is named here by its role only.
StepContext = Any


class ModelAdapter(Protocol):
    """One library's models under cpctl."""

    def model_in(self, model: nn.Module) -> nn.Module | None:
        """The model of this library that `model` is or wraps, else None."""

    def prepare(self, model: nn.Module, context: StepContext) -> bool:
        """Route `model` (as `model_in` found it) through cpctl with `context`. Returns whether the
        model had its own activation checkpointing, now turned off for cpctl's to replace it."""

    def unprepared_refused(self) -> contextlib.AbstractContextManager:
        """Inside a step split over several ranks: this library's models that cpctl did not prepare refused."""

    def causal_lm_loss_sum(self, model: nn.Module, context: StepContext, *, input_ids: torch.Tensor,
                           labels: torch.Tensor, chunk_tokens: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's causal-LM loss summed over this rank's tokens without the full logits, and
        the shifted labels it counted (the runtime makes them the global token mean)."""


_ADAPTERS: list[ModelAdapter] = []


def register(adapter: ModelAdapter) -> None:
    """Add `adapter` once (registering the same adapter again changes nothing)."""
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)


def adapter_for(model: nn.Module) -> tuple[ModelAdapter, nn.Module] | None:
    """The registered adapter that knows `model`, with the model it found in it; None: none does."""
    for adapter in _ADAPTERS:
        inner = adapter.model_in(model)
        if inner is not None:
            return adapter, inner
    return None


@contextlib.contextmanager
def unprepared_models_refused() -> Iterator[None]:
    """Every registered adapter's refusal of the models cpctl did not prepare."""
    with contextlib.ExitStack() as stack:
        for adapter in _ADAPTERS:
            stack.enter_context(adapter.unprepared_refused())
        yield
