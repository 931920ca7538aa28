"""Token-wise layers of a block over the sequence in tiles, each tile recomputed in backward.

A layer that works token by token (an MLP, a LayerNorm or RMSNorm) computes on a tile of tokens
exactly what it computes on the whole sequence. Run in tiles under a checkpoint per tile, its
intermediate tensors exist for one tile at a time, forward and backward: at long lengths the
MLP's (tokens x ffn) and a norm's fp32 copies and backward (several tensors of tokens x model
width in fp32) are the largest of a block. The layer's own `forward` is replaced on the
instance, not wrapped in a new module, so parameter names (and checkpoints) stay the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpctl.errors import CpctlError

# Normalization layers by their class's name: torch's and the Hugging Face models' (LlamaRMSNorm, ...).
NORM_SUFFIXES = ("LayerNorm", "RMSNorm")


class TiledForward:
    """A layer's forward over the sequence (dim 1) in tiles of `tile_tokens`, each checkpointed."""

    def __init__(self, forward: Callable[..., torch.Tensor], *, tile_tokens: int, name: str, key: str) -> None:
        self.forward, self.tile_tokens, self.name, self.key = forward, tile_tokens, name, key

    def __call__(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if args or kwargs or not isinstance(hidden, torch.Tensor):
            raise CpctlError(f"{self.key}: {self.name} takes more than one (batch, tokens, width) tensor; "
                             f"set {self.key}: 0 for this model")
        if hidden.dim() < 3:
            raise CpctlError(f"{self.key}: {self.name} gets a {hidden.dim()}-D tensor {tuple(hidden.shape)}; tiles "
                             f"split (batch, tokens, width) along the tokens; set {self.key}: 0 for this model")
        tiles = hidden.split(self.tile_tokens, dim=1)
        outputs = [checkpoint(self.forward, tile, use_reentrant=False) for tile in tiles]
        if not all(isinstance(out, torch.Tensor) and out.shape[:2] == tile.shape[:2] for out, tile in zip(outputs, tiles)):
            raise CpctlError(f"{self.key}: {self.name} does not map each token to one output token (a mixture of "
                             f"experts returning router logits?); set {self.key}: 0")
        return torch.cat(outputs, dim=1)


def _tile(layer: nn.Module, *, tile_tokens: int, key: str) -> None:
    layer.forward = TiledForward(layer.forward, tile_tokens=tile_tokens, name=type(layer).__name__, key=key)


def apply_tiled_mlp(blocks: list[nn.Module], *, tile_tokens: int) -> None:
    """Each block's `mlp` (the name Hugging Face decoder layers and the example use) in tiles."""
    missing = [type(block).__name__ for block in blocks if not isinstance(getattr(block, "mlp", None), nn.Module)]
    if missing or not blocks:
        raise CpctlError(f"memory.tiled_mlp_tokens: no `mlp` submodule in {missing[0] if missing else 'the model'}'s "
                         "blocks; set memory.tiled_mlp_tokens: 0, or name the block's MLP `mlp`")
    for block in blocks:
        _tile(block.mlp, tile_tokens=tile_tokens, key="memory.tiled_mlp_tokens")


def is_norm(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.LayerNorm, nn.RMSNorm)) or type(layer).__name__.endswith(NORM_SUFFIXES)


def apply_tiled_norms(blocks: list[nn.Module], *, tile_tokens: int, model: nn.Module | None = None) -> None:
    """Each block's normalization layers (its direct children: a decoder layer's input and
    post-attention norms) in tiles, and, given the model, the norms beside the blocks (the
    decoder's final norm, whose backward opens the backward pass). Norms nested deeper (a
    per-head q/k norm) work on small tensors and stay whole."""
    norms = [[child for child in block.children() if is_norm(child)] for block in blocks]
    if not blocks or not all(norms):
        name = type(blocks[norms.index([])]).__name__ if blocks else "the model"
        raise CpctlError(f"memory.tiled_norm_tokens: no LayerNorm or RMSNorm among {name}'s direct children; "
                         "set memory.tiled_norm_tokens: 0")
    beside = _norms_beside(model, blocks) if model is not None else []
    for layer in [*(layer for found in norms for layer in found), *beside]:
        _tile(layer, tile_tokens=tile_tokens, key="memory.tiled_norm_tokens")


def _norms_beside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The norms that are direct children of the module holding the blocks' list (LlamaModel's `norm`)."""
    for holder in model.modules():
        if any(isinstance(child, nn.ModuleList) and any(item is blocks[0] for item in child) for child in holder.children()):
            return [child for child in holder.children() if is_norm(child)]
    return []


def tiled_layers(model: nn.Module) -> list[TiledForward]:
    """The tiled forwards installed in `model` (for tests and `--dry-run`-like reports)."""
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]
