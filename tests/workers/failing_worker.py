"""A worker for tests/test_launch.py that fails after cpctl.init(), as a training script's mistake would.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/failing_worker.py --rank R [--error value]
    python tests/workers/failing_worker.py --rank 0 --error value --leave DIR   # a process alone

Every rank starts the runtime and meets the others at a barrier; then rank R fails: with a
CpctlError (sharding a 7-token sequence over 2 CP ranks with load balancing: it does not divide),
or with a ValueError of the script's own. The other ranks wait at a second barrier, which gloo
ends with "Connection closed by peer" when rank R is gone: the secondary failure.
With --leave DIR the script leaves what a process alone must still get done at its exit: a file
written and never flushed (DIR/buffered.txt) and an atexit handler (it writes DIR/atexit.txt).
"""

import argparse
import atexit
from pathlib import Path

import torch
import torch.distributed as dist

import cpctl

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--error", choices=["cpctl", "value"], default="cpctl")
parser.add_argument("--leave", type=Path, help="leave DIR/buffered.txt unflushed; at exit write DIR/atexit.txt")
args = parser.parse_args()

if args.leave:
    # registered before cpctl.init(), so it runs after cpctl's own exit handler
    atexit.register((args.leave / "atexit.txt").write_text, "ran at exit")
    unflushed = open(args.leave / "buffered.txt", "w")  # noqa: SIM115 - left open on purpose: Python flushes it at exit
    unflushed.write("written before the failure")

rt = cpctl.init()
dist.barrier()  # every rank is up before one fails
print("worker ready", flush=True)
if rt.rank == args.rank:
    if args.error == "cpctl":
        rt.shard(torch.arange(7).unsqueeze(0), seq_dim=1)
    raise ValueError("batch 3 has no labels")
dist.barrier()
