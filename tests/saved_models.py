"""What a run saved in Hugging Face's format, read back as plain tensors (every shard, by name)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def saved_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The weights in `directory`: model.safetensors, or every shard its index names."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights |= load_file(directory / name)
    return weights


def largest_difference(a: Path, b: Path) -> float:
    """The largest difference between two saves of the same model; they must hold the same names."""
    one, other = saved_weights(a), saved_weights(b)
    assert one.keys() == other.keys(), sorted(one.keys() ^ other.keys())
    return max((one[name].float() - other[name].float()).abs().max().item() for name in one)
