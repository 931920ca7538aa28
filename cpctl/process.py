"""The process group's life: started once per process, torn down cleanly at exit."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

_FAILED = False  # an exception ended the script: peers may never reach the exit barrier
_EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=30)


def start(device: torch.device, *, on_exit: Callable[[], None]) -> None:
    """nccl on cuda, gloo on cpu; under a launcher its rendezvous, else a world of one."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _note_uncaught_exceptions()
    atexit.register(_shutdown, on_exit)


def _note_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def hook(*exc_info):
        global _FAILED
        _FAILED = True
        previous(*exc_info)

    sys.excepthook = hook


def _shutdown(on_exit: Callable[[], None]) -> None:
    """Tear the process groups down while Python is fully alive.

    gloo's worker threads may still hold the tensors of finished collectives; if they free them
    during interpreter finalization, the thread is killed mid-destructor and the process aborts
    ("terminate called without an active exception", exit 134). A barrier first lets every
    rank's threads go idle and no rank close connections a peer still uses; collecting garbage
    after destroy_process_group frees the groups FSDP's and the mesh's reference cycles hold.
    """
    on_exit()
    if not dist.is_initialized():
        return
    if not _FAILED and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        with contextlib.suppress(RuntimeError):  # a peer that never arrives must not hold this rank
            dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
    dist.destroy_process_group()
    gc.collect()
