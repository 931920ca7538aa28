"""Selective activation checkpointing: a checkpointed block recomputes everything but attention.

At long lengths attention is the expensive part of a block (quadratic, and under CP it moves
K/V between ranks), while what it must keep for its backward (Q, K, V, its output and
log-sum-exp) is linear in the sequence. So the block's forward records what each attention
call returned, and keeps attention's own saved tensors out of the checkpoint's discard; the
recompute in backward replays the recorded outputs in call order instead of calling attention
again. Everything else in the block (projections, norms, the MLP) is recomputed as with full
checkpointing, so only attention's tensors are added to what the step holds.

Non-reentrant checkpointing matches recomputed tensors to the forward's by the order they are
saved; attention saves nothing through the checkpoint in either pass, so the orders agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from cpctl.errors import CpctlError
from cpctl.runtime.pinned import HostArena, Packed


def keep_on_device() -> AbstractContextManager:
    """Saved tensors stay where they are (the checkpoint's hooks would drop them)."""
    return saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)


class AttentionMemo:
    """One checkpointed block call's attention outputs: recorded in its forward, replayed in its recompute.

    With an `arena`, what attention saves and the recorded outputs wait in its host memory,
    like the rest of what the step keeps for backward (memory.offload_activations).
    """

    def __init__(self, *, arena: HostArena | None = None):
        self.arena = arena
        self.outputs: list[Packed | tuple[torch.Tensor, bool]] = []  # host copies, or (kept, requires_grad)
        self.replaying = False
        self.replayed = 0
        self.depth = 0  # > 0 inside a recorded call: nested attention calls belong to it

    def call(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.depth:
            return compute()
        if self.replaying:
            return self._next()
        self.depth += 1
        try:
            with self.arena.saved_tensors() if self.arena is not None else keep_on_device():
                output = compute()
        finally:
            self.depth -= 1
        if self.arena is not None:
            self.outputs.append(self.arena.pack(output.detach().requires_grad_(output.requires_grad)))
        else:
            self.outputs.append((output.detach(), output.requires_grad))
        return output

    def _next(self) -> torch.Tensor:
        if self.replayed >= len(self.outputs):
            raise CpctlError("memory.checkpoint_level: selective: a block's recompute called attention more "
                             "often than its forward did (does the block branch on something that changed?); "
                             "use checkpoint_level: full")
        kept = self.outputs[self.replayed]
        self.replayed += 1
        if isinstance(kept, Packed):
            return self.arena.unpack(kept).requires_grad_(kept.requires_grad)
        # Requiring grad as the original did: what the next ops save depends on it.
        tensor, requires_grad = kept
        return tensor.detach().requires_grad_(requires_grad)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with _MemoizeSDPA(self):
            yield

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        # From the first output each time: a backward with retain_graph recomputes again.
        self.replaying, self.replayed = True, 0
        try:
            with _MemoizeSDPA(self):
                yield
        finally:
            self.replaying = False


class _MemoizeSDPA(TorchFunctionMode):
    """SDPA calls (routed to the CP engine or not) go through the memo."""

    def __init__(self, memo: AttentionMemo):
        super().__init__()
        self.memo = memo

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.memo.call(lambda: func(*args, **kwargs))
        return func(*args, **kwargs)
