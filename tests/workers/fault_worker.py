"""Worker for tests/test_faults.py and tests/test_checkpoint.py: `hang` (rank 1 stops answering
before a collective the others wait in), `sleep` (every rank writes its pid to argv[2] and
sleeps, for killing the launcher), `train` (every rank writes its pid to
argv[2]/rank{R}-attempt{A}.pid, then runs scripts/train_llama.py with the arguments after it:
a test kills the rank it means, by pid) or `sigkill-once` (a tiny model checkpointed every step
to argv[2]/ckpt; on the first attempt rank 1 kills itself with SIGKILL once step 2 is saved; each
rank writes the step it started from to argv[2]/rank{R}-attempt{A}.start)."""

import os
import signal
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
elif mode == "sleep":
    with open(os.path.join(sys.argv[2], f"pid{rt.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
elif mode == "sigkill-once":
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = cpctl.Checkpointer(Path(sys.argv[2]) / "ckpt")
    start = checkpoints.load_latest(model=model, optimizer=optimizer)
    (Path(sys.argv[2]) / f"rank{rt.rank}-attempt{attempt}.start").write_text(str(start))
    for step in range(start, 4):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpoints.save(step + 1, model=model, optimizer=optimizer)
        if attempt == 0 and rt.rank == 1 and step + 1 == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no report, no exit handler
