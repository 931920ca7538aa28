"""Worker for tests/test_faults.py: `hang` (rank 1 stops answering before a collective the others
wait in) or `sleep` (every rank writes its pid to argv[2] and sleeps, for killing the launcher)."""

import os
import sys
import time

import torch
import torch.distributed as dist

import cpctl

mode = sys.argv[1]
rt = cpctl.init()
if mode == "hang":
    if rt.rank == 1:
        time.sleep(3600)  # stuck in its own code, never reaching the collective
    dist.all_reduce(torch.ones(1))
elif mode == "sleep":
    with open(os.path.join(sys.argv[2], f"pid{rt.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
