"""A sequence whose length the CP layout does not divide, padded at its end.

The layout cuts a row into `num_chunks` equal chunks (2 x cp_size with load balance), so a
length it does not divide (a collator's longest row of the batch, 63 tokens) is made whole by
appending tokens after the last one. Causal attention never lets a token see the tokens after
it, so every real token's output is the one-process output; what remains is that nothing counts
the appended tokens: their labels are ignored (-100), their positions continue the row's, the
buffers restored on exit and the results gathered back (`rt.unshard`) drop them again. Attention
that looks ahead (not causal) would see them: that is refused where it is called.

How each buffer is padded, when the caller does not say (`pad_values`):
* an integer buffer holding the ignore index (-100) anywhere is a labels tensor: -100;
* any other buffer repeats its last value along the sequence (token ids stay valid ids, a
  mask of ones stays ones, a mask that already ends in zeros stays right-padded).
A caller that knows its buffers by name (the transformers Trainer's inputs, a Hugging Face
model's keyword arguments) says -100 for labels, 0 for an attention mask and `POSITIONS`
(count on from the last position) for position ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

IGNORE_INDEX = -100
POSITIONS = "positions"  # a pad value: continue counting from the row's last position
PadValue = Union[int, float, str, None]  # None: the default rule above


@dataclass(frozen=True)
class EndPadding:
    """A step's padding: `length` real tokens, sharded as `padded`."""

    length: int
    padded: int

    @property
    def extra(self) -> int:
        return self.padded - self.length

    def describe(self) -> str:
        return f"the sequence of {self.length} tokens was padded to {self.padded}"


def plan(length: int, *, divisor: int) -> EndPadding | None:
    """The padding a `length`-token row needs to split into `divisor` chunks (None: none)."""
    if length == 0 or length % divisor == 0:
        return None
    return EndPadding(length=length, padded=-(-length // divisor) * divisor)


def default_value(tensor: torch.Tensor) -> PadValue:
    if not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool \
            and bool((tensor == IGNORE_INDEX).any()):
        return IGNORE_INDEX
    return None


def pad(tensor: torch.Tensor, *, seq_dim: int, padding: EndPadding, value: PadValue = None) -> torch.Tensor:
    """`tensor` (of `padding.length` along `seq_dim`) with `padding.extra` tokens appended."""
    seq_dim = seq_dim % tensor.dim()
    if value is None:
        value = default_value(tensor)
    last = tensor.narrow(seq_dim, padding.length - 1, 1)
    shape = list(tensor.shape)
    shape[seq_dim] = padding.extra
    if value is None:
        tail = last.expand(shape)
    elif value == POSITIONS:
        steps = torch.arange(1, padding.extra + 1, device=tensor.device, dtype=tensor.dtype)
        view = [1] * tensor.dim()
        view[seq_dim] = padding.extra
        tail = last + steps.view(view)
    else:
        tail = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, tail], dim=seq_dim)


def check_values(values: list[PadValue] | None, *, buffers: int) -> None:
    from cpctl.errors import CpctlError

    if values is None:
        return
    if len(values) != buffers:
        raise CpctlError(f"maybe_context_parallel: {buffers} buffers but {len(values)} pad_values; give one per buffer "
                         f"(a number, \"{POSITIONS}\" or None)")
    for value in values:
        if not (value is None or value == POSITIONS or (isinstance(value, (int, float)) and not isinstance(value, bool))):
            raise CpctlError(f"maybe_context_parallel: pad_values holds {value!r}; each is a number, "
                             f"\"{POSITIONS}\" (continue the positions) or None (cpctl's rule)")
