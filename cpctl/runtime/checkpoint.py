"""Checkpoints on PyTorch's own sharded format (torch.distributed.checkpoint): save, resume, export.

    ckpt = cpctl.Checkpointer("runs/ckpt", keep=3)
    start = ckpt.load_latest(model=model, optimizer=optimizer, loader=loader)   # 0 when there is none
    for step, batch in enumerate(loader, start=start):
        ...
        if (step + 1) % 100 == 0:
            ckpt.save(step + 1, model=model, optimizer=optimizer, loader=loader)

Every rank writes its own shards in parallel. A checkpoint is written into `step-N.partial/`
and renamed to `step-N/` by rank 0 only once every rank has finished: a run killed mid-write
leaves a `.partial` directory that is never loaded (and is removed by the next save). The
format stores every tensor's global shape, so a checkpoint saved at cp 2 x dp_shard 2 loads at
cp 4 or in one process. The RNG states are per rank and restored only when the world size is
the same; the data loader resumes at the batch after the last one saved.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cpctl.errors import CpctlError

_STEP_DIR = re.compile(r"step-(\d+)$")
_PARTIAL = ".partial"
_META = "cpctl-meta.pt"


@dataclass
class Checkpointer:
    """Saves to and resumes from `directory`, keeping the newest `keep` checkpoints.

    `async_save=True`: `save` copies the state to CPU memory and returns while a background
    thread writes it; the checkpoint is completed (renamed, counted) at the next `save`,
    `load`, or `wait()`. Call `wait()` before the script ends.
    """

    directory: str | os.PathLike
    keep: int = 3
    async_save: bool = False

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.keep < 1:
            raise CpctlError(f"Checkpointer(keep={self.keep}): keep at least 1 checkpoint")
        self._pending: tuple[Any, Path, Path] | None = None  # (future, partial, final) of an async save
        self._cpu_group = None  # async writes need a group that takes CPU tensors (gloo)
        if self.async_save and dist.is_initialized() and dist.get_backend() != "gloo":
            self._cpu_group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ save

    def save(self, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             loader: Any = None, extra: dict[str, Any] | None = None) -> Path:
        """Write checkpoint `step` (collective: every rank calls it); returns its directory."""
        self.wait()
        final = self.directory / f"step-{step:09d}"
        partial = final.with_name(final.name + _PARTIAL)
        if _is_main():
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("step-*" + _PARTIAL):  # an earlier run killed mid-write
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
        state = {"model": model_state, "optim": optim_state}
        meta = {"step": step, "world_size": _world(), "rng": _rng_state(),
                "loader": loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None,
                "extra": extra or {}}
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._cpu_group)
            partial.mkdir(parents=True, exist_ok=True)
            torch.save(meta, partial / f"rank{_rank()}-{_META}")
            self._pending = (future, partial, final)
            return final
        dcp.save(state, checkpoint_id=str(partial))
        torch.save(meta, partial / f"rank{_rank()}-{_META}")
        self._complete(partial, final)
        return final

    def wait(self) -> None:
        """Finish an asynchronous save in flight (collective); nothing to do otherwise."""
        if self._pending is not None:
            future, partial, final = self._pending
            self._pending = None
            future.result()
            self._complete(partial, final)

    def _complete(self, partial: Path, final: Path) -> None:
        _barrier()  # every rank's shards are on disk before the checkpoint counts
        if _is_main():
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            for old in self.checkpoints()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()

    # ------------------------------------------------------------------ load

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (a `.partial` directory is never one)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return [path for _, path in sorted(found)]

    def load_latest(self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    loader: Any = None) -> int:
        """Restore the newest checkpoint into `model` (and `optimizer`, `loader`); returns its step,
        0 when there is none. Collective: every rank calls it."""
        self.wait()
        found = self.checkpoints()
        return self.load(found[-1], model=model, optimizer=optimizer, loader=loader)["step"] if found else 0

    def load(self, path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             loader: Any = None) -> dict[str, Any]:
        """Restore checkpoint `path`; returns its metadata (step, extra). Works at any parallel layout."""
        self.wait()
        path = Path(path)
        if path.name.endswith(_PARTIAL) or not (path / ".metadata").is_file():
            raise CpctlError(f"{path}: not a complete cpctl checkpoint (interrupted while written?); "
                             f"use one of {', '.join(p.name for p in self.checkpoints()) or 'none found'}")
        optimizers = optimizer if optimizer is not None else []
        model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = _read_meta(path)
        if meta["world_size"] == _world():  # per-rank states mean nothing under another layout
            _set_rng_state(meta["rng"])
        if loader is not None and meta.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(meta["loader"])
        return meta


def export(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """A single-file `torch.save` of a checkpoint's model weights, for use outside cpctl:
    `model.load_state_dict(torch.load(output))`, then e.g. `save_pretrained`. Needs no processes."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint, output = Path(checkpoint), Path(output)
    if not (checkpoint / ".metadata").is_file():
        raise CpctlError(f"{checkpoint}: not a complete cpctl checkpoint; pass a step-N directory")
    whole = output.with_name(output.name + ".all")
    dcp_to_torch_save(str(checkpoint), str(whole))
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    torch.save(state["model"], output)
    return output


def _read_meta(path: Path) -> dict[str, Any]:
    mine = path / f"rank{_rank()}-{_META}"
    chosen = mine if mine.is_file() else path / f"rank0-{_META}"  # another world size: step and loader agree
    return torch.load(chosen, weights_only=False)


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _is_main() -> bool:
    return _rank() == 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
