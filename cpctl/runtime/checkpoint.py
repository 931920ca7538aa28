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

Faults end in one line, the same on every rank: a directory that cannot be written, a full disk
(the partial checkpoint is removed, the latest complete one stays the latest), a checkpoint
whose files were truncated or changed after they were written (runtime/integrity.py names the
file; `load_latest` then moves it aside to `step-N.damaged` and resumes from the newest
complete one before it, saying so on one line).
"""

from __future__ import annotations

import logging
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cpctl.errors import CpctlError
from cpctl.failure_report import note_checkpoint
from cpctl.runtime import disk, integrity

_STEP_DIR = re.compile(r"step-(\d+)$")
_PARTIAL = ".partial"
_DAMAGED = ".damaged"
_META = "cpctl-meta.pt"
_log = logging.getLogger("cpctl")


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
        self._pending: tuple[Any, Path, Path, dict] | None = None  # (future, partial, final, meta) of an async save
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
        problem = None
        if _is_main():
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob("step-*" + _PARTIAL):  # an earlier run killed mid-write
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError as exc:
                problem = self._cannot_write(exc, final=final)
        _agree(problem)
        model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
        state = {"model": model_state, "optim": optim_state}
        meta = {"step": step, "world_size": _world(), "rng": _rng_state(),
                "loader": loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None,
                "extra": extra or {}}
        if self.async_save:
            try:
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._cpu_group)
            except (OSError, CheckpointException) as exc:
                self._finish(partial, final, meta, problem=self._cannot_write(exc, final=final))
            self._pending = (future, partial, final, meta)
            return final
        try:
            dcp.save(state, checkpoint_id=str(partial))
        except (OSError, CheckpointException) as exc:
            problem = self._cannot_write(exc, final=final)
        self._finish(partial, final, meta, problem=problem)
        return final

    def wait(self) -> None:
        """Finish an asynchronous save in flight (collective); nothing to do otherwise."""
        if self._pending is not None:
            future, partial, final, meta = self._pending
            self._pending = None
            problem = None
            try:
                future.result()
            except (OSError, CheckpointException) as exc:
                problem = self._cannot_write(exc, final=final)
            self._finish(partial, final, meta, problem=problem)

    def _finish(self, partial: Path, final: Path, meta: dict[str, Any], *, problem: str | None) -> None:
        """Every rank's metadata and record of its files, then the rename; or, when a rank could not
        write, the partial checkpoint removed and the same one line raised on every rank."""
        if problem is None:
            try:
                name = f"rank{_rank()}-{_META}"
                torch.save(meta, partial / name)
                integrity.record(partial, rank=_rank(), world=_world(),
                                 names=integrity.written_by(partial, rank=_rank(), meta_name=name))
            except Exception as exc:  # noqa: BLE001 - torch.save reports a short write as a RuntimeError
                problem = self._cannot_write(exc, final=final)
        try:
            _agree(problem)
        except CpctlError:
            if _is_main():  # every rank has stopped writing: nothing half-written stays behind
                shutil.rmtree(partial, ignore_errors=True)
            raise
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
        note_checkpoint(final, step=int(_STEP_DIR.match(final.name).group(1)))  # `cpctl launch` names it at a restart

    def _cannot_write(self, exc: BaseException, *, final: Path) -> str:
        """One line: which checkpoint, where, why (the OS's reason), what is kept, and the fix."""
        rank, cause = _root_os_error(exc)
        on = f" (rank {rank})" if rank is not None and _world() > 1 else ""
        latest = self.checkpoints()
        kept = f"the latest complete checkpoint is still {latest[-1].name}" if latest else "no complete checkpoint yet"
        fix = disk.write_failure(cause if isinstance(cause, OSError) else None, exc, directory=self.directory,
                                 kept=kept, size=_size(latest[-1]) if latest else 0, on=on,
                                 room="keep fewer checkpoints (Checkpointer(keep=...)) or save to another directory")
        return f"checkpoint {final.name} in {self.directory}: {fix}"

    # ------------------------------------------------------------------ load

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (a `.partial` directory is never one)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return [path for _, path in sorted(found)]

    def load_latest(self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    loader: Any = None) -> int:
        """Restore the newest complete checkpoint into `model` (and `optimizer`, `loader`); returns
        its step, 0 when there is none. Collective: every rank calls it.

        A newest checkpoint whose files are damaged is moved aside (`step-N.damaged`) and the one
        before it is loaded, said on one line; when none is left, one error line names the file."""
        self.wait()
        found = self.checkpoints()
        damaged: list[tuple[Path, integrity.Damage]] = []
        for path in reversed(found):
            damage = self._damage(path)
            if damage is None:
                if damaged:
                    self._set_aside(damaged, resumed=path)
                step = self._load(path, model=model, optimizer=optimizer, loader=loader)["step"]
                note_checkpoint(path, step=step)  # what a restart resumes from again, until the next save
                return step
            damaged.append((path, damage))
        if damaged:
            path, damage = damaged[0]
            raise CpctlError(f"checkpoint {path}: {damage.file} is damaged ({damage.what}) and no earlier complete "
                             f"checkpoint is in {self.directory}; move {path.name} away to start from scratch")
        return 0

    def load(self, path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             loader: Any = None) -> dict[str, Any]:
        """Restore checkpoint `path`; returns its metadata (step, extra). Works at any parallel layout."""
        self.wait()
        path = Path(path)
        if path.name.endswith(_PARTIAL) or not (path / ".metadata").is_file():
            raise CpctlError(f"{path}: not a complete cpctl checkpoint (interrupted while written?); "
                             f"use one of {', '.join(p.name for p in self.checkpoints()) or 'none found'}")
        damage = self._damage(path)
        if damage is not None:
            others = [p.name for p in self.checkpoints() if p != path]
            raise CpctlError(f"checkpoint {path}: {damage.file} is damaged ({damage.what}); load another "
                             f"({', '.join(others) or 'none in ' + str(self.directory)})")
        return self._load(path, model=model, optimizer=optimizer, loader=loader)

    def _load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              loader: Any) -> dict[str, Any]:
        optimizers = optimizer if optimizer is not None else []
        model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as exc:
            rank, cause = _root_os_error(exc)
            raise CpctlError(f"checkpoint {path}: cannot be loaded into this model and optimizer (rank {rank}: "
                             f"{type(cause).__name__}: {disk.first_line(cause)}); was it saved from another model?") from None
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = _read_meta(path)
        if meta["world_size"] == _world():  # per-rank states mean nothing under another layout
            _set_rng_state(meta["rng"])
        if loader is not None and meta.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(meta["loader"])
        return meta

    def _damage(self, path: Path) -> integrity.Damage | None:
        """The first damaged file of checkpoint `path`, as every rank agrees (the ranks share the reading)."""
        listed, damage = integrity.entries(path)
        if damage is None and listed:
            names = sorted(listed)
            damage = integrity.check(path, names[_rank()::_world()], listed)
        elif damage is None and _is_main():
            damage = integrity.check_sizes_from_metadata(path)  # written before records existed
        found = [d for d in _gather(damage) if d is not None]
        return found[0] if found else None

    def _set_aside(self, damaged: list[tuple[Path, integrity.Damage]], *, resumed: Path) -> None:
        """Damaged checkpoints newer than the one resumed from are renamed, so that none is taken as
        latest (nor kept in place of a good one when old checkpoints are pruned)."""
        if _is_main():
            for path, _ in damaged:
                aside = path.with_name(path.name + _DAMAGED)
                shutil.rmtree(aside, ignore_errors=True)  # set aside before, and saved again since
                os.replace(path, aside)
            path, damage = damaged[0]
            _log.warning("cpctl: checkpoint %s is damaged (%s: %s); resuming from %s instead (the damaged one is "
                         "now %s)", path, damage.file, damage.what, resumed.name, path.name + _DAMAGED)
        _barrier()


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
    try:
        return torch.load(chosen, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a file that does not unpickle is damaged, whatever the error
        raise CpctlError(f"checkpoint {path}: {chosen.name} is damaged ({type(exc).__name__}); load another "
                         "checkpoint") from None


def _agree(problem: str | None) -> None:
    """Raise `problem` (the lowest rank's, when several have one) on every rank, or nothing on any."""
    found = [p for p in _gather(problem) if p is not None]
    if found:
        raise CpctlError(found[0])


def _gather(item: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [item]
    items: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


def _root_os_error(exc: BaseException) -> tuple[int | None, BaseException | None]:
    """(rank, cause): the first failing rank's exception from a CheckpointException (the OSError in
    its chain when there is one), or the exception itself."""
    rank, cause = None, exc
    if isinstance(exc, CheckpointException) and exc.failures:
        rank = min(exc.failures)
        failure = exc.failures[rank]
        cause = failure[0] if isinstance(failure, tuple) else failure
    return rank, disk.os_error_in(cause) or cause


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


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
