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
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from cpctl.errors import CpctlError


def keep_on_device() -> AbstractContextManager:
    """Saved tensors stay where they are (the checkpoint's hooks would drop them)."""
    return saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)


class AttentionMemo:
    """One checkpointed block call's attention outputs: recorded in its forward, replayed in its recompute.

    With `offload`, what attention saves and the recorded outputs wait in pinned host memory,
    like the rest of what the step keeps for backward (memory.offload_activations).
    """

    def __init__(self, *, offload: bool = False):
        self.offload = offload
        self.outputs: list[tuple[torch.Tensor, torch.device, bool]] = []  # (kept, device, requires_grad)
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
            with save_on_cpu(pin_memory=True) if self.offload else keep_on_device():
                output = compute()
        finally:
            self.depth -= 1
        kept = output.detach()
        if self.offload:
            kept = torch.empty(kept.shape, dtype=kept.dtype, pin_memory=True).copy_(kept, non_blocking=True)
        self.outputs.append((kept, output.device, output.requires_grad))
        return output

    def _next(self) -> torch.Tensor:
        if self.replayed >= len(self.outputs):
            raise CpctlError("memory.checkpoint_level: selective: a block's recompute called attention more "
                             "often than its forward did (does the block branch on something that changed?); "
                             "use checkpoint_level: full")
        kept, device, requires_grad = self.outputs[self.replayed]
        self.replayed += 1
        # Requiring grad as the original did: what the next ops save depends on it.
        return kept.to(device, non_blocking=True).requires_grad_(requires_grad)

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
