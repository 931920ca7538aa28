"""Helpers for tests that start real processes (`cpctl launch`, torchrun, scripts): the repository
root, a clean environment, the CLI in a subprocess, waiting for it with a time limit, and running
each expensive launch once per module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TypeVar

import pytest

REPO = Path(__file__).resolve().parent.parent
STARTUP = REPO / "tests" / "startup"  # the sitecustomize of every process a test starts
TIMEOUT = 120
# Variables that would change what a profile resolves to, or how torchrun behaves.
AMBIENT_PREFIXES = ("CPCTL_", "SLURM_", "PET_", "TORCHELASTIC_", "ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_")

T = TypeVar("T")


def tiered(values: Iterable[T], quick: Collection[T]) -> list:
    """Parameters for a launch matrix: the cases in `quick` run in both tiers, the others only in
    the full tier (`pytest --full`). A tuple is one value per argument name, as parametrize takes it."""
    return [value if value in quick else pytest.param(*value if isinstance(value, tuple) else (value,),
                                                       marks=pytest.mark.full)
            for value in values]


def launch_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment minus anything that would change the profile or torchrun, plus the
    tests' start-up (tests/startup/sitecustomize.py: no garbage collections at exit)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(AMBIENT_PREFIXES)}
    # nothing reaches the network: Hugging Face libraries read local files only, and send no telemetry
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env |= {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(STARTUP), str(REPO), env.get("PYTHONPATH")]))}
    return env


def cpctl(*args: str, tmp_path: Path, cwd: Path | None = None, env: dict[str, str] | None = None,
          extra_env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """`cpctl launch ARGS` in a subprocess: in `env` (default: launch_env), plus `extra_env`.

    Ctrl-C reaches it as from a terminal even where pytest itself runs with SIGINT ignored (a
    background job of a non-interactive shell, as CI may start it): a process that starts with
    SIGINT ignored keeps ignoring it, and a test's SIGINT would then never arrive."""
    return subprocess.Popen(
        [sys.executable, "-m", "cpctl.launch.cli", "launch", *args], cwd=cwd or tmp_path,
        env=(env or launch_env(tmp_path)) | (extra_env or {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=_sigint_as_from_a_terminal, **popen,
    )


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def probed_env(tmp_path: Path) -> dict[str, str]:
    """launch_env with the CP probe on (tests/startup/cp_probe.py): each worker writes
    tmp_path/probe/rank{R}.json at exit."""
    (tmp_path / "probe").mkdir(exist_ok=True)
    return launch_env(tmp_path) | {"CP_PROBE_DIR": str(tmp_path / "probe")}


def probed(tmp_path: Path, world: int = 2) -> list[dict]:
    """What the probe recorded per rank: cp_size, each CP step's tokens, every attention's query length."""
    return [json.loads((tmp_path / "probe" / f"rank{rank}.json").read_text()) for rank in range(world)]


_STARTED: list[subprocess.Popen] = []  # processes started beside a launch (start_python, started), until their test ends


def stop_started() -> None:
    """Kills what start_python or started started and nobody waited for (its test failed first):
    a reference or launch left running would take a core from the tests after it (a launcher
    killed takes its workers with it)."""
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def started(proc: subprocess.Popen) -> subprocess.Popen:
    """`proc`, killed at its test's end if nobody waited for it (stop_started)."""
    _STARTED.append(proc)
    return proc


def start_python(*argv: str, cwd: Path) -> Callable[[], str]:
    """Starts `python ARGV` in launch_env and returns what waits for it to exit 0 and gives its
    output: a one-process reference that runs while the launch it is compared with starts (both
    spend seconds importing; the 2 cores of a small machine would otherwise take turns idling)."""
    # its output to a file, not a pipe: nobody reads it until the launch is over, and a full pipe
    # would stop the process half-way
    log = cwd / f"python-{len(list(cwd.glob('python-*.log')))}.log"
    with log.open("w") as output:
        proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=launch_env(cwd), stdout=output,
                                stderr=subprocess.STDOUT, text=True)
    started(proc)

    def wait() -> str:
        finish(proc, what=f"python {' '.join(argv[:2])}")
        printed = log.read_text(errors="replace")
        assert proc.returncode == 0, printed
        return printed

    return wait


def plain_losses(script: Path, *args: str, tmp_path: Path) -> dict:
    """The losses file of `python SCRIPT ARGS --losses-out FILE`: one plain process, the reference."""
    return start_plain(script, *args, tmp_path=tmp_path)()


def start_plain(script: Path, *args: str, tmp_path: Path) -> Callable[[], dict]:
    """plain_losses, started (start_python): call the result for the losses file."""
    out = tmp_path / "losses.json"
    done = start_python(str(script), *args, "--losses-out", str(out), cwd=tmp_path)
    return lambda: (done(), json.loads(out.read_text()))[1]


def error_lines(stderr: str) -> list[str]:
    """The launcher's error lines (the one line a failure must be)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def finish(proc: subprocess.Popen, what: str = "cpctl launch") -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish in {TIMEOUT}s:\n{out}\n{err}")
    return proc.returncode, out, err


def launch_once(tmp_path_factory: pytest.TempPathFactory, name: str,
                launch: Callable[..., T]) -> Callable[..., T]:
    """`get(*key)`: `launch(tmp_dir, *key)` on the first call for that key, in a fresh temporary
    directory; every later call gets its result. A failed launch is not repeated: the first test
    that asked for it shows the error, later ones fail with its message."""
    results: dict[tuple, T] = {}
    failures: dict[tuple, str] = {}

    def get(*key: object) -> T:
        if key in failures:
            pytest.fail(f"{name} {key}: the launch failed (see the first test that used it):\n{failures[key]}",
                        pytrace=False)
        if key not in results:
            tmp = tmp_path_factory.mktemp("-".join([name, *map(str, key)]))
            try:
                results[key] = launch(tmp, *key)
            except (Exception, pytest.fail.Exception) as error:
                failures[key] = str(error) or type(error).__name__
                raise
        return results[key]

    return get
