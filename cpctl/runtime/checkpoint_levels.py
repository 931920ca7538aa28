"""Which checkpointed blocks are selective: memory.checkpoint_level per block.

`full` recomputes every block whole in backward; `selective` keeps attention's tensors in every
block (faster, more memory); `mixed` makes the last `memory.selective_blocks` blocks selective
and the others full. Each block is exact on its own, so any mix is exact. The last blocks are
the ones chosen: backward reaches them first, so the first block backward recomputes keeps its
attention tensors instead of making them again at the step's peak, and they are freed first.

With `selective_blocks: fit` the count is `cpctl plan`'s: the most selective blocks that fit
this GPU's memory (torch's total; on cpu the planner's default GPU) for the step's batch and
sequence length, read from the first block's input, and a chunked loss (`rt.causal_lm_loss`).
The model's shape comes from its config: a Hugging Face config, or one with the planner's own
field names (the example's `Llama.cfg`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from cpctl import planner
from cpctl.config import Profile
from cpctl.config.schema import FIT
from cpctl.errors import CpctlError

_log = logging.getLogger("cpctl")
_SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim")


def model_shape(model: nn.Module) -> planner.ModelShape | None:
    """The planner's view of `model`, from its config; None when it has no config cpctl reads."""
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):  # transformers
        return planner.model_from_hf_config(config.to_dict(), name=type(model).__name__)
    config = getattr(model, "cfg", config)
    if config is not None and all(isinstance(getattr(config, name, None), int) for name in _SHAPE_FIELDS):
        return planner.ModelShape(type(model).__name__, *(getattr(config, name) for name in _SHAPE_FIELDS),
                                  tied_embeddings=bool(getattr(config, "tied_embeddings", False)))
    return None


class BlockLevels:
    """The level of each of `blocks` checkpointed blocks, step by step."""

    def __init__(self, profile: Profile, *, blocks: int, model: nn.Module, device: torch.device) -> None:
        memory = profile.memory
        self.profile, self.blocks, self.device = profile, blocks, device
        self.level = memory.checkpoint_level
        self.shape: planner.ModelShape | None = None
        self._chosen: dict[tuple[int, int], int] = {}  # (batch, local tokens) -> selective blocks
        self.count: int | None = {"full": 0, "selective": blocks}.get(self.level)
        if self.level != "mixed":
            return
        if memory.selective_blocks != FIT:
            if memory.selective_blocks > blocks:
                raise CpctlError(f"memory.selective_blocks: {memory.selective_blocks} but the model has {blocks} "
                                 f"checkpointed blocks; set at most {blocks}")
            self.count = memory.selective_blocks
            return
        self.shape = model_shape(model)
        if self.shape is None:
            raise CpctlError(f"checkpoint_level: mixed cannot read {type(model).__name__}'s shape (no Hugging Face "
                             "config); set memory.selective_blocks: N, the count `cpctl plan --model ... --seq-len "
                             "... --checkpoint-level mixed` prints")
        if self.shape.n_layers != blocks:
            raise CpctlError(f"checkpoint_level: mixed: {type(model).__name__}'s config says {self.shape.n_layers} "
                             f"layers but {blocks} blocks are checkpointed; set memory.selective_blocks: N")

    @property
    def choosing(self) -> bool:
        """Whether the count follows the step's shape (selective_blocks: fit)."""
        return self.shape is not None

    def observe(self, hidden: Any) -> None:
        """The first block's input of a step: its batch and tokens decide the count (fit)."""
        if not self.choosing or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return
        key = (int(hidden.shape[0]), int(hidden.shape[1]))
        if key not in self._chosen:
            self._chosen[key] = self.choose(batch=key[0], local_tokens=key[1])
            _log.info("checkpoint_level mixed: selective for the last %d of %d blocks at %d x %d tokens per GPU",
                      self._chosen[key], self.blocks, key[0], key[1])
        self.count = self._chosen[key]

    def choose(self, *, batch: int, local_tokens: int) -> int:
        """`cpctl plan`'s count for this step: the most selective blocks that fit."""
        setup = dataclasses.replace(planner.Setup.from_profile(self.profile, chunked_loss=True, batch=batch),
                                    selective_blocks=None)
        found = planner.estimate(self.shape, setup, local_tokens * setup.cp, gpu_memory_gib=self.gpu_memory_gib())
        return found.setup.selective_blocks or 0

    def gpu_memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory / planner.GiB
        return planner.DEFAULT_GPU_MEMORY_GIB

    def selective(self, index: int) -> bool:
        """Whether block `index` (in forward order) keeps attention's tensors this step."""
        count = self.count or 0
        return index >= self.blocks - count
