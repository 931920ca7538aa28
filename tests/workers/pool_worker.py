"""One rank of tests/pool.py's long-lived gloo pool, started once per session by torch.distributed.run.

    python -m torch.distributed.run --standalone --nproc-per-node W tests/workers/pool_worker.py JOBS_DIR OWNER_PID

torch, transformers and cpctl are imported once, here; then each job (JOBS_DIR/job{N}.json: a worker
script, its arguments, its cwd and environment) runs as `python SCRIPT ARGS` would, in every rank,
on the process group this pool started; a script for accelerate (CPCTL_SCRIPT_API=accelerate) as
`cpctl launch` runs one: with the variables the launcher sets for it, through cpctl's accelerate
shim. Each job starts as a fresh process would: no cpctl runtime, no patch of another library, no
accelerate state from the job before; the process group stays (a job's teardown is a barrier).
Each rank prints to JOBS_DIR/job{N}.rank{R}.out, and then writes JOBS_DIR/job{N}.rank{R}.json:
whether the script ended well, its traceback otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

import cpctl  # noqa: F401  (imported once for every job)
import cpctl.runtime.runtime
from cpctl import config
from cpctl.integrations.patches import PATCHES
from cpctl.launch.accelerate_env import accelerate_env

with contextlib.suppress(ImportError):  # most jobs build Hugging Face models
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM, MistralForCausalLM  # noqa: F401  (their modeling modules)

# Between looks for the next job: short right after one (a test's next job usually follows at
# once), longer while the pool idles (a rank looking every 10 ms kept 1.2% of a core busy, and
# the session's pools idle most of the time).
FIRST_POLL_S, LONGEST_POLL_S = 0.002, 0.05


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def forget_runtime() -> None:
    """Each job's cpctl.init() builds its own runtime (its profile, its mesh) on the pool's process group."""
    runtime = cpctl.runtime.runtime
    if not hasattr(runtime, "_RUNTIME"):
        raise RuntimeError("cpctl.runtime.runtime._RUNTIME is gone: tests/workers/pool_worker.py must learn how "
                           "cpctl.init() keeps its runtime now")
    runtime._RUNTIME = None
    runtime._INIT_OVERRIDES = {}


def forget_accelerate() -> None:
    """accelerate's process-wide singletons, as a fresh process has them (not yet made)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@contextlib.contextmanager
def process_group_kept() -> Iterator[None]:
    """A job's destroy of the default process group (accelerate's end_training, a script's own
    teardown) is a barrier instead: the pool's next job runs on the same group."""
    destroy = dist.destroy_process_group

    def keep(group=None) -> None:
        if group is not None:
            return destroy(group)
        dist.barrier()

    dist.destroy_process_group = keep
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def run_as_launched(script: str, args: list[str]) -> None:
    """The script, as `cpctl launch` would run it with the profile in the environment."""
    if os.environ.get("CPCTL_SCRIPT_API") != "accelerate":
        runpy.run_path(script, run_name="__main__")
        return
    from cpctl.integrations import accelerate_shim

    profile = config.for_worker({}, environ=os.environ, cuda_devices=0).profile
    os.environ.update(accelerate_env(profile))  # what the launcher gives each worker of an accelerate script
    accelerate_shim.main([script, *args])


def run(job: dict, output: Path) -> str | None:
    """Runs the job; returns None, or why it failed. What it prints goes to `output` as it is printed."""
    environ, cwd, argv, path = dict(os.environ), os.getcwd(), sys.argv, list(sys.path)
    failure = None
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path.insert(0, str(Path(job["script"]).parent))  # as `python SCRIPT` has it
    forget_runtime()
    try:
        with output.open("w", buffering=1) as printed, contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(printed), process_group_kept():
            run_as_launched(job["script"], job["args"])
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            failure = f"exited {exit_.code}"
    except BaseException:  # noqa: BLE001 - every failure is the job's result
        failure = traceback.format_exc()
    finally:
        forget_runtime()
        forget_accelerate()
        PATCHES.remove()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv = argv
        sys.path[:] = path
    return failure


def main() -> None:
    jobs, owner = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    # A rank whose agent or test session is gone (killed, or a failed job's pool stopped) must not
    # wait for jobs forever.
    agent = os.getppid()
    # a job that leaves its peers waiting fails in the pool's time limit; this one only ends a forgotten pool
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    number = 0
    while True:
        job_file = jobs / f"job{number}.json"
        wait = FIRST_POLL_S
        while not job_file.exists():
            if os.getppid() != agent or not alive(owner):
                os._exit(1)
            time.sleep(wait)
            wait = min(wait * 1.5, LONGEST_POLL_S)
        job = json.loads(job_file.read_text())
        if job.get("stop"):
            break
        failure = run(job, jobs / f"job{number}.rank{rank}.out")
        done = jobs / f"job{number}.rank{rank}.json"
        partial = done.with_suffix(".partial")
        partial.write_text(json.dumps({"failure": failure}))
        partial.rename(done)  # the test side never reads half a result
        number += 1
    dist.barrier()  # every rank has read the stop: none is left waiting in a collective
    # Nothing is left to flush or free: the interpreter's and the process group's teardown (seconds
    # per process) would only keep the session waiting.
    os._exit(0)


if __name__ == "__main__":
    main()
