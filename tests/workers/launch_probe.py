"""A worker for tests/test_launch.py: records what `cpctl launch` gave this rank. No torch import.

    cpctl launch --device cpu --nproc-per-node 2 tests/workers/launch_probe.py --out DIR [--fail-rank R --fail-code C] [--sleep S]

Writes DIR/rank{RANK}.json with RANK, WORLD_SIZE, LOCAL_RANK, the profile from
CPCTL_RESOLVED_PROFILE and its own argv; then exits with --fail-code on --fail-rank, or sleeps.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-code", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0)
args, extra = parser.parse_known_args()

rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "pid": os.getpid(),
    "profile": json.loads(os.environ["CPCTL_RESOLVED_PROFILE"]),
    "extra_args": extra,
}
args.out.mkdir(parents=True, exist_ok=True)
(args.out / f"rank{rank}.json.tmp").write_text(json.dumps(record))
(args.out / f"rank{rank}.json.tmp").rename(args.out / f"rank{rank}.json")  # appears whole
print(f"probe says hello (world {record['world_size']})", flush=True)
if rank == args.fail_rank:
    print("probe fails on purpose", file=sys.stderr, flush=True)
    sys.exit(args.fail_code)
time.sleep(args.sleep)
