"""The chunked linear cross-entropy against the plain one, in one process: value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpctl.errors import CpctlError
from cpctl.integrations.huggingface import _check_logits
from cpctl.runtime.losses import chunked_linear_cross_entropy


def softcap(logits: torch.Tensor) -> torch.Tensor:
    return torch.tanh(logits / 3.0) * 3.0


@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("transform", [None, softcap])
def test_chunked_loss_equals_the_full_one(chunk_tokens: int, with_bias: bool, transform) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    bias = torch.randn(50, generator=gen, requires_grad=True) if with_bias else None
    labels = torch.randint(50, (3, 37), generator=gen)
    labels[0, :5] = -100  # ignored tokens
    logits = F.linear(hidden, weight, bias)
    full = F.cross_entropy((transform(logits) if transform else logits).flatten(0, 1), labels.flatten(), reduction="sum")
    expected = torch.autograd.grad(full, [hidden, weight, *([bias] if with_bias else [])])
    chunked = chunked_linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=chunk_tokens,
                                           transform=transform)
    got = torch.autograd.grad(chunked, [hidden, weight, *([bias] if with_bias else [])])
    assert abs(chunked.item() - full.item()) <= 1e-6 * abs(full.item())
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() <= 1e-5 * max(1.0, e.abs().max().item())


def test_chunked_loss_refuses_mismatched_shapes() -> None:
    with pytest.raises(CpctlError, match="12 hidden states but 10 labels"):
        chunked_linear_cross_entropy(torch.zeros(12, 4), torch.zeros(5, 4), torch.zeros(10, dtype=torch.long))
    with pytest.raises(CpctlError, match="chunk_tokens must be at least 1"):
        chunked_linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                                     chunk_tokens=0)


def test_a_model_whose_logits_cpctl_cannot_reproduce_is_refused() -> None:
    head = torch.nn.Linear(4, 6, bias=False)
    hidden = torch.randn(2, 4)
    _check_logits(head(hidden), hidden, head, None, head)  # the same computation passes
    with pytest.raises(CpctlError, match="computes its logits in a way cpctl's chunked loss does not reproduce"):
        _check_logits(head(hidden) * 2 + 1, hidden, head, None, head)
