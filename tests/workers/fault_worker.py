"""Worker for tests/test_faults.py and tests/test_checkpoint.py: `hang` (rank 1 stops answering
before a collective the others wait in), `sleep` (every rank writes its pid to argv[2] and
sleeps, for killing the launcher), `segfault` (rank 1 reads address 0 in native code) or `train` (every rank writes its pid to
argv[2]/rank{R}-attempt{A}.pid, then runs scripts/train_llama.py with the arguments after it:
a test kills the rank it means, by pid)."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cpctl

mode = sys.argv[1]
rt = cpctl.init()
if mode == "hang":
    if rt.rank == 1:
        time.sleep(3600)  # stuck in its own code, never reaching the collective
    dist.all_reduce(torch.ones(1))
elif mode == "train":
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    written = Path(sys.argv[2]) / f"rank{rt.rank}-attempt{attempt}.pid"
    written.with_suffix(".tmp").write_text(str(os.getpid()))
    written.with_suffix(".tmp").replace(written)  # whole, or not there
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from train_llama import main

    main(sys.argv[3:])
elif mode == "segfault":

    def crash_in_native_code() -> None:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV

    if rt.rank == 1:
        crash_in_native_code()
    dist.barrier()
elif mode == "sleep":
    with open(os.path.join(sys.argv[2], f"pid{rt.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
