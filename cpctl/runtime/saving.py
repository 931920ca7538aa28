"""A sharded model written as one process's files: gathered together, written once, never half.

A model FSDP2 (or TP) shards is on no rank whole. Saving it is collective: every rank arrives
(checked through the c10d store, so a save called on rank 0 only is one line instead of a hang),
the full weights are gathered to rank 0's host (torch.distributed.checkpoint's
`get_model_state_dict`), and rank 0 writes them into a staging directory beside the target that
is moved in only once complete: a full disk, an unwritable directory or a kill leaves the files
that were there before as they were. Whatever happens on rank 0, every rank returns or raises the
same one-line error together.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import itertools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cpctl.errors import CpctlError
from cpctl.runtime import disk, process

CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"  # what activation checkpointing adds to parameter names
# Ranks come to a save from the same synchronous step, seconds apart at most; a rank missing for
# this long (or for the profile's comm_timeout, if shorter) is not coming: the save was called on some ranks only.
ARRIVAL_TIMEOUT_S = 120
# Weight files of a Hugging Face save (plain or sharded, safetensors or pickle) and their index:
# a new save replaces all of them, so a sharded save never leaves an older unsharded file beside it.
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
_saves = itertools.count()


@contextlib.contextmanager
def checkpoint_wrappers_lifted(model: nn.Module) -> Iterator[None]:
    """Inside, each activation-checkpointing wrapper's place in `model` is held by the block it wraps,
    so module names are the unwrapped model's (a library that reads them, as peft's adapter save
    does, finds what it made); put back on exit. For writing only: no forward runs meanwhile."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    lifted = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, CheckpointWrapper)]
    for parent, name, wrapper in lifted:
        setattr(parent, name, wrapper._checkpoint_wrapped_module)
    try:
        yield
    finally:
        for parent, name, wrapper in lifted:
            setattr(parent, name, wrapper)


def is_sharded(model: nn.Module) -> bool:
    """Whether some parameter of `model` is a DTensor (FSDP2 or TP): only a collective gather makes it whole."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def full_state_dict(model: nn.Module, *, what: str) -> dict[str, torch.Tensor]:
    """The model's full weights on rank 0's host under the names the unwrapped model has ({} on
    other ranks). Collective: every rank calls it; `what` names the call for the error when some do not."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    arrive_together(what)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name.replace(CHECKPOINT_WRAPPER, ""): tensor for name, tensor in full.items()}


def full_tensors(model: nn.Module, *, select: Callable[[str, torch.Tensor], bool], what: str) -> dict[str, torch.Tensor]:
    """The full tensors of the parameters and buffers `select` keeps (rank 0's host; {} on other
    ranks), under the unwrapped model's names: a model's adapters without gathering its base.
    Collective, like full_state_dict."""
    return full_tensors_of(model.state_dict().items(), select=select, what=what)


def full_tensors_of(named: Iterable[tuple[str, torch.Tensor]], *, what: str,
                    select: Callable[[str, torch.Tensor], bool] = lambda name, tensor: True) -> dict[str, torch.Tensor]:
    """full_tensors over (name, tensor) pairs that every rank lists in the same order (a state dict
    the caller took from a sharded model)."""
    from torch.distributed.tensor import DTensor

    arrive_together(what)
    main = is_main_rank()
    whole: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if not select(name, tensor):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if main:
            whole[name.replace(CHECKPOINT_WRAPPER, "")] = full.detach().to("cpu", copy=True)
    return whole


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def holds_shards(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether a state dict the caller passed still holds shards (DTensors: `model.state_dict()` of
    a sharded model), which only a gather of every rank makes whole."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(tensor, DTensor) for tensor in state_dict.values())


def arrive_together(what: str) -> None:
    """Return once every rank has called it, or raise: a gather that some ranks never join would
    hang until the process group's timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    timeout_s = min(ARRIVAL_TIMEOUT_S, process.comm_timeout_s())
    world, key = dist.get_world_size(), f"cpctl/arrived/{next(_saves)}"
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise CpctlError(f"{what} gathers the sharded weights from every rank, but only {arrived} of {world} "
                             f"ranks called it within {timeout_s:.0f} s: call it on every rank (not under "
                             "`if rt.is_main:` or `if accelerator.is_main_process:`; rank 0 alone writes the "
                             "files), or gather on every rank first (state_dict = accelerator.get_state_dict("
                             "model)) and save that state_dict= on rank 0")
        time.sleep(0.05)


def write_together(directory: str | os.PathLike, write: Callable[[Path], None], *, what: str) -> Path:
    """Rank 0 calls `write(staging)` and moves what it wrote into `directory`; every rank returns
    once the files are in place, or raises the same one-line error (the files there before kept)."""
    directory = Path(directory)
    problem = _written(directory, write, what=what) if is_main_rank() else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [problem if problem is None or isinstance(problem, str) else f"rank 0: {disk.first_line(problem)}"]
        dist.broadcast_object_list(shared, src=0)
        if isinstance(problem, BaseException):
            raise problem
        problem = shared[0]
    elif isinstance(problem, BaseException):
        raise problem
    if problem is not None:
        raise CpctlError(problem)
    return directory


def write_here(directory: str | os.PathLike, write: Callable[[Path], None], *, what: str) -> Path:
    """`write(staging)` moved into `directory` by this rank alone, waiting for no other (weights
    gathered before: a save under `if accelerator.is_main_process:`); a failure is this rank's
    one-line error, the files there before kept."""
    directory = Path(directory)
    problem = _written(directory, write, what=what)
    if isinstance(problem, BaseException):
        raise problem
    if problem is not None:
        raise CpctlError(problem)
    return directory


def _written(directory: Path, write: Callable[[Path], None], *, what: str) -> str | BaseException | None:
    """What went wrong writing `directory` atomically: a disk's failure in words, another error as
    raised, or None."""
    try:
        _write_atomically(directory, write)
    except OSError as exc:
        kept = "the files there before are as they were" if directory.exists() else "nothing was written"
        return f"{what} to {directory}: " + disk.write_failure(exc, exc, directory=directory, kept=kept, size=0)
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, then it is raised as it was
        return exc
    return None


def _write_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    in_the_way = next((path for path in directory.parents if path.exists() and not path.is_dir()), None)
    if in_the_way is not None:  # mkdir would say "File exists", which names no fix
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(in_the_way))
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0o700 would become the saved directory's mode
    try:
        write(staging)
        if not directory.exists():
            os.replace(staging, directory)
            return
        written = {path.name for path in staging.iterdir()}
        for path in staging.iterdir():
            target = directory / path.name
            if target.is_dir() and not path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "a directory is in the way of a file", str(target))
            if path.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
        if any(_WEIGHT_FILE.match(name) for name in written):
            for old in directory.iterdir():
                if _WEIGHT_FILE.match(old.name) and old.name not in written:
                    old.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
