"""A long-lived pool of gloo worker processes, shared by the session, for tests whose subject is
what runs inside the workers (engine numerics, runtime and Hugging Face equality checks), not
the launcher: a launch costs each process an `import torch` (and transformers), seconds of CPU
per process; the pool pays it once. What `cpctl launch` itself does keeps real launches
(test_launch.py, test_faults.py, test_training.py's cp 2, accelerate's own command line, TRL's
sft script, the docs' commands, ...).

A job is a worker script run as `python SCRIPT ARGS` would run it, in every rank at once
(tests/workers/pool_worker.py), with the profile `cpctl launch FLAGS` would give it, as the
CPCTL_* variables a plain torchrun job reads; a script for accelerate (`--script-api accelerate`)
as the launcher runs one, through cpctl's shim with accelerate's variables. A job that fails, or does not end in time, fails
its test with every failed rank's traceback and output; where a rank did not end the job (it may
wait for a peer that left), the pool is stopped and the next job starts a fresh one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from launching import REPO, launch_env

WORKER = REPO / "tests" / "workers" / "pool_worker.py"
JOB_TIMEOUT = 300
# between looks for a job's results: short at first (many jobs take a fraction of a second),
# longer for long jobs, so that waiting costs this process little CPU
FIRST_POLL_S, LONGEST_POLL_S = 0.002, 0.05
STOP_TIMEOUT_S = 30
FAILED_PEERS_GRACE_S = 5  # after one rank failed, how long the others get to end their job


def profile_env(flags: Sequence[str]) -> dict[str, str]:
    """`cpctl launch` flags (`--cp-size 2 ...`) as the CPCTL_<KEY> variables of the same keys."""
    names, values = flags[::2], flags[1::2]
    assert len(names) == len(values) and all(name.startswith("--") for name in names), flags
    return {"CPCTL_" + name[2:].replace("-", "_").upper(): value for name, value in zip(names, values)}


class Pool:
    """`world` gloo processes under torch.distributed.run, started on the first job."""

    def __init__(self, world: int, root: Path) -> None:
        self.world, self.root = world, root
        self.proc: subprocess.Popen | None = None
        self.generation = 0  # each start gets a fresh jobs directory
        self.jobs = root
        self.count = 0

    def _start(self) -> None:
        self.generation += 1
        self.jobs = self.root / f"pool{self.generation}"
        self.jobs.mkdir()
        self.count = 0
        self.log = self.jobs / "pool.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.world),
                 str(WORKER), str(self.jobs), str(os.getpid())],  # its ranks end with this process
                cwd=self.jobs, env=launch_env(self.root), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        """Ends the pool's processes: torch.distributed.run stops its workers on SIGTERM (a worker
        whose agent is gone ends by itself: tests/workers/pool_worker.py)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def ask_to_stop(self) -> None:
        """The ranks' last job: leave the process group together and exit."""
        if self.proc is not None and self.proc.poll() is None:
            self._submit({"stop": True})

    def wait_and_stop(self) -> None:
        """After ask_to_stop: waits for the ranks to leave, then ends whatever is left."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.stop()

    def _submit(self, job: dict) -> int:
        number = self.count
        self.count += 1
        partial = self.jobs / f"job{number}.partial"
        partial.write_text(json.dumps(job))
        partial.rename(self.jobs / f"job{number}.json")
        return number

    def attempt(self, script: Path, *args: str, flags: Sequence[str] = (), cwd: Path,
                env: Mapping[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> Outcome:
        """`cpctl launch FLAGS SCRIPT ARGS` in the pool's ranks, as a launch would end: see `run`."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        number = self._submit({"script": str(script), "args": list(args), "cwd": str(cwd),
                               "env": profile_env(["--device", "cpu", *flags]) | dict(env or {})})
        done = [self.jobs / f"job{number}.rank{rank}.json" for rank in range(self.world)]
        deadline, why = time.monotonic() + timeout, f"no result in {timeout:.0f}s"
        wait = FIRST_POLL_S
        while not all(path.exists() for path in done):
            if any(path.exists() and json.loads(path.read_text())["failure"] for path in done):
                # its peers may wait for it forever
                grace = time.monotonic() + FAILED_PEERS_GRACE_S
                if grace < deadline:
                    deadline, why = grace, f"no result {FAILED_PEERS_GRACE_S}s after another rank failed"
            if self.proc.poll() is not None:
                why = f"no result: the pool exited {self.proc.returncode}; its log:\n{self.log.read_text()[-4000:]}"
                break
            if time.monotonic() > deadline:
                break
            time.sleep(wait)
            wait = min(wait * 1.5, LONGEST_POLL_S)
        failures = [json.loads(path.read_text())["failure"] if path.exists() else why for path in done]
        outputs = [self._printed(number, rank) for rank in range(self.world)]
        if not all(path.exists() for path in done):
            self.stop()  # a rank still in the job, maybe waiting for a peer that left it
        return Outcome(failures, outputs)

    def _printed(self, number: int, rank: int) -> str:
        path = self.jobs / f"job{number}.rank{rank}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def run(self, script: Path, *args: str, flags: Sequence[str] = (), cwd: Path,
            env: Mapping[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> list[str]:
        """`cpctl launch FLAGS SCRIPT ARGS` in the pool's ranks (the flags' process count must be the
        pool's: cpctl.init checks it), with `env` set too; returns what each rank printed. A failure
        fails the test with every failed rank's traceback and output."""
        outcome = self.attempt(script, *args, flags=flags, cwd=cwd, env=env, timeout=timeout)
        if not outcome.ok:
            pytest.fail(f"{script.name} {' '.join(args)} failed in the pool of {self.world} (flags {list(flags)}):\n"
                        + outcome.report(), pytrace=False)
        return outcome.outputs


@dataclass(frozen=True)
class Outcome:
    """A job's end in each rank: None or why it failed (its traceback), and what it printed."""

    failures: list[str | None]
    outputs: list[str]

    @property
    def ok(self) -> bool:
        return not any(self.failures)

    def report(self) -> str:
        return "\n".join(f"rank {rank}: {failure}\n{output[-4000:]}"
                         for rank, (failure, output) in enumerate(zip(self.failures, self.outputs)) if failure)

    def refusals(self) -> list[str]:
        """Each rank's CpctlError, from a job that must fail on every rank alike (a rank left
        waiting would hang a real job): the launcher prints such an error as one line (test_launch.py)."""
        assert all(self.failures), self.report() or "the job did not fail"
        last_lines = [failure.strip().splitlines()[-1] for failure in self.failures]
        assert all(line.startswith("cpctl.errors.CpctlError: ") for line in last_lines), last_lines
        return [line.removeprefix("cpctl.errors.CpctlError: ") for line in last_lines]


class Pools:
    """The session's pools, one per process count, each made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_world: dict[int, Pool] = {}

    def __getitem__(self, world: int) -> Pool:
        if world not in self.by_world:
            directory = self.root / f"world{world}"
            directory.mkdir()
            self.by_world[world] = Pool(world, directory)
        return self.by_world[world]

    def run(self, script: Path, *args: str, flags: Sequence[str], cwd: Path,
            env: Mapping[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> list[str]:
        """Pool.run in the pool of the flags' `--nproc-per-node`."""
        world = int(flags[list(flags).index("--nproc-per-node") + 1])
        return self[world].run(script, *args, flags=flags, cwd=cwd, env=env, timeout=timeout)

    def close(self) -> None:
        for pool in self.by_world.values():  # all at once: each stop takes its ranks a moment
            pool.ask_to_stop()
        for pool in self.by_world.values():
            pool.wait_and_stop()
