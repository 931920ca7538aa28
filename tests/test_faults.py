"""Faults through real launches (CPU, gloo): a killed worker is restarted and the run resumes
with the losses of an uninterrupted run in one process; a hung rank ends the job within the comm
timeout, named; workers die with a SIGKILLed launcher. And the failure report a worker writes, as
the launcher reads it."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish, launch_env, tiered

from cpctl.failure_report import ERROR_DIR_ENV_VAR, FailureReport
from cpctl.launch import failures

SCRIPT = REPO / "scripts" / "train_llama.py"
WORKER = REPO / "tests" / "workers" / "fault_worker.py"
STEPS, KILL_AFTER = 8, 3
SLOW = ("--seq-len", "1024")  # steps long enough (a few tenths of a second) to kill a worker mid-run
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, pools) -> list[float]:
    """The example's losses in one process, uninterrupted (the session's pool of one, tests/pool.py)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "losses.json"
    pools[1].run(SCRIPT, "--steps", str(STEPS), *SLOW, "--losses-out", str(out), cwd=tmp)
    return json.loads(out.read_text())["losses"]


# a restart must work every time, not one time in five
@pytest.mark.parametrize("attempt", tiered(range(3), quick={0}))
def test_a_killed_rank_is_restarted_and_the_run_resumes(uninterrupted, tmp_path: Path, attempt: int) -> None:
    out, ckpt, pids = tmp_path / "losses.json", tmp_path / "ckpt", tmp_path / "pids"
    pids.mkdir()
    proc = cpctl("--profile", "cpu-try", "--max-restarts", "1", str(WORKER), "train", str(pids), "--steps", str(STEPS),
                 *SLOW, "--checkpoint-dir", str(ckpt), "--save-every", "1", "--losses-out", str(out), tmp_path=tmp_path)
    saved, victim = ckpt / f"step-{KILL_AFTER:09d}", pids / "rank1-attempt0.pid"
    deadline = time.monotonic() + 90
    while not (saved.exists() and victim.exists()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # kill rank 1 as soon as step KILL_AFTER is saved
    assert proc.poll() is None and victim.exists(), "the run ended before rank 1 could be killed"
    os.kill(int(victim.read_text()), signal.SIGKILL)  # rank 1 itself, by the pid it wrote
    code, stdout, stderr = finish(proc)
    output = stdout + stderr
    assert code == 0, output
    assert (pids / "rank1-attempt1.pid").exists(), output  # torchrun started the workers again
    run = json.loads(out.read_text())
    assert KILL_AFTER <= run["first_step"] <= STEPS - 1, output  # resumed from a checkpoint, not from scratch
    # the restart said why, and named the checkpoint the workers then resumed from
    (line,) = [line for line in stderr.splitlines() if line.startswith("cpctl: restart")]
    # torchelastic names whichever failed rank it saw first: the killed one, or rank 0, which lost its peer
    killed = line.startswith("cpctl: restart 1 of 1: rank 1 (pid ") and ") was killed by SIGKILL (signal 9)" in line
    silent = line.startswith("cpctl: restart 1 of 1: rank 1 ended without a report, so by a signal (SIGKILL")
    assert killed or silent, line
    first = run["first_step"]
    assert line.endswith(f"; load_latest resumes from checkpoint step {first} at {ckpt / f'step-{first:09d}'}"), line
    for step, loss in enumerate(run["losses"], start=run["first_step"]):
        assert abs(loss - uninterrupted[step]) <= TOLERANCE, (step, run, uninterrupted)


def test_a_restart_line_names_the_root_cause_and_the_checkpoint(tmp_path: Path) -> None:
    """Restarts as torchelastic logs a failed attempt, on the reports and note workers leave."""
    import logging

    from cpctl.failure_report import note_checkpoint

    logs, error_dir = tmp_path / "logs", tmp_path / "errors"
    peer = FailureReport(rank=0, host="node0", summary="RuntimeError: Connection closed by peer",
                         traceback_file="/tmp/cpctl-x/rank0-attempt0-traceback.txt", time=1.0, peer_lost=True)
    mine = FailureReport(rank=1, host="node0", summary="ValueError: batch 3 has no labels",
                         traceback_file="/tmp/cpctl-x/rank1-attempt1-traceback.txt", time=2.0, peer_lost=False)
    for attempt, local_rank, report in ((0, 0, peer), (1, 0, peer), (1, 1, mine)):
        written = logs / "run_abc" / f"attempt_{attempt}" / str(local_rank) / "error.json"
        written.parent.mkdir(parents=True)
        written.write_text(report.error_file_json(traceback_text="Traceback ..."))
    error_dir.mkdir()
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    fail = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    restarts = failures.Restarts(max_restarts=2, logs=logs, error_dir=error_dir, nnodes=1, ranks={4001: 1},
                                 killed_by=lambda name, pid: f"{name} (as MemoryWatch names it)")
    with restarts, pytest.MonkeyPatch.context() as env:
        logger.error(fail, -9, 1, 4001, "python")  # attempt 0: rank 1 killed; rank 0 only lost its peer
        env.setenv(ERROR_DIR_ENV_VAR, str(error_dir))
        (tmp_path / "ckpt" / "step-000000004").mkdir(parents=True)
        note_checkpoint(tmp_path / "ckpt" / "step-000000004", step=4)
        logger.error(fail, 1, 0, 4000, "python")  # attempt 1: rank 1 raised, rank 0 lost its peer first
        logger.error(fail, 1, 1, 4101, "python")  # attempt 2, the last: the launch's error, not a restart
    assert restarts.lines == [
        "restart 1 of 2: rank 1 (pid 4001) was killed by SIGKILL (as MemoryWatch names it); "
        "no checkpoint saved or loaded through cpctl.Checkpointer yet",
        "restart 2 of 2: rank 1 failed: ValueError: batch 3 has no labels (traceback: "
        f"/tmp/cpctl-x/rank1-attempt1-traceback.txt on node0); load_latest resumes from checkpoint step 4 at "
        f"{tmp_path / 'ckpt' / 'step-000000004'}",
    ]
    assert restarts not in logger.filters


def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path: Path) -> None:
    start = time.monotonic()
    code, stdout, stderr = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--comm-timeout", "5",
                                        str(WORKER), "hang", tmp_path=tmp_path))
    elapsed = time.monotonic() - start
    assert code != 0 and elapsed < 60, (elapsed, stdout, stderr)
    assert "error: rank 0:" in stderr and "rank 1 stopped answering" in stderr, stderr


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address = bytes.fromhex(fields[1].split(":")[0])
                if table == "tcp":
                    found.append(str(ipaddress.IPv4Address(address[::-1])))
                else:  # four 32-bit words, each in host (little-endian) order
                    words = b"".join(address[i:i + 4][::-1] for i in range(0, 16, 4))
                    found.append(str(ipaddress.IPv6Address(words)))
    return found


def test_the_stores_listen_on_loopback_and_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    proc = cpctl("--device", "cpu", "--nproc-per-node", "2", str(WORKER), "sleep", str(tmp_path), tmp_path=tmp_path)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2, "the workers did not start"
    # the launcher hosts the rendezvous store and the workers' store: loopback only, never *:PORT
    listening = listening_addresses(proc.pid)
    assert len(listening) >= 2 and all(ipaddress.ip_address(a).is_loopback for a in listening), listening
    for pid in pids:
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert environ["MASTER_ADDR"] == "127.0.0.1"
    proc.kill()  # SIGKILL: no handler runs in the launcher
    proc.communicate()
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # do not leave them behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher"


@pytest.mark.full
def test_a_launch_leaves_nothing_in_the_temp_dir(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = subprocess.run([sys.executable, "-m", "cpctl.launch.cli", "launch", "--profile", "cpu-try", str(SCRIPT),
                           "--steps", "1"], cwd=tmp_path, env=launch_env(tmp_path) | {"TMPDIR": str(temp)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    left = [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "cpctl-"))]
    assert left == []  # (torch's own inductor cache, shared by every run, may be there)


def test_a_worker_killed_by_signal_9_is_named_and_told_apart_from_the_oom_killer(tmp_path: Path) -> None:
    proc = cpctl("--device", "cpu", "--nproc-per-node", "2", str(WORKER), "sleep", str(tmp_path), tmp_path=tmp_path)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(tmp_path.glob("pid*"))) == 2, "the workers did not start"
    time.sleep(1.5)  # the launcher samples each worker's memory once a second
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    code, stdout, stderr = finish(proc)
    assert code == 128 + signal.SIGKILL, stdout + stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "worker rank 1" in line and "was killed by SIGKILL (signal 9)" in line, line
    assert re.search(r"it held \d+\.\d GiB", line), line
    if failures.oom_kills() is not None:  # this machine counts OOM kills: it knows this was not one
        assert "not by this machine's out-of-memory killer" in line, line


def test_a_worker_that_crashes_in_native_code_shows_its_python_stack(tmp_path: Path) -> None:
    proc = cpctl("--device", "cpu", "--nproc-per-node", "2", str(WORKER), "segfault", tmp_path=tmp_path)
    code, stdout, stderr = finish(proc)
    assert code == 128 + signal.SIGSEGV, stdout + stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "worker rank 1" in line and "was killed by SIGSEGV (signal 11)" in line, line
    # faulthandler's dump (the launcher sets PYTHONFAULTHANDLER), under the rank's prefix
    crashed = [line for line in (stdout + stderr).splitlines() if line.startswith("[rank1]")]
    assert any("Fatal Python error: Segmentation fault" in line for line in crashed), stdout + stderr
    assert any("in crash_in_native_code" in line for line in crashed), stdout + stderr


@pytest.mark.parametrize(("oom", "offload", "expected", "absent"), [
    (True, ["memory.offload_activations: true"],
     [("SIGKILL (signal 9) from the kernel's out-of-memory killer: host memory ran out (it held 98.0 GiB of this "
       "machine's 125.0 GiB)"), "memory.offload_activations: true keeps tensors in host memory",
      "`cpctl plan --model ... --seq-len ... --host-memory 125` shows what a step needs", "turn the offload off"], []),
    (True, [], ["out-of-memory killer", "fewer processes per machine"], ["keeps tensors"]),
    (False, [], ["not by this machine's out-of-memory killer", "another process or a scheduler"], ["host memory ran"]),
    (None, [], ["see dmesg"], ["not by"]),
])
def test_how_a_sigkill_is_named(oom, offload, expected, absent) -> None:
    text = failures.describe_kill("SIGKILL", oom=oom, resident=98 * 2**30, host=125 * 2**30, offload=offload)
    for fragment in expected:
        assert fragment in text, text
    for fragment in absent:
        assert fragment not in text, text
    assert failures.describe_kill("SIGTERM", oom=True, resident=None, host=None, offload=[]) == "SIGTERM (signal 15)"


def test_a_failure_report_round_trips_and_nothing_else_reads_as_one() -> None:
    first = FailureReport(rank=3, host="node1", summary="ValueError: batch 3 has no labels",
                          traceback_file="/tmp/cpctl-x/rank3-traceback.txt", time=1700000000.25, peer_lost=False)
    second = FailureReport(rank=0, host="node0", summary="RuntimeError: Connection closed by peer",
                           traceback_file="/tmp/cpctl-x/rank0-traceback.txt", time=1700000001.5, peer_lost=True,
                           after=first)
    for report in (first, second):
        assert FailureReport.from_json(report.to_json()) == report
        error_file = json.loads(report.error_file_json(traceback_text="Traceback ..."))
        assert FailureReport.from_error_file_data(error_file) == report
        assert error_file["message"]["message"] == report.summary  # what torchelastic's own reader takes
    assert (first.first, first.secondary, second.first, second.secondary) == (first, False, first, True)
    data = json.loads(first.to_json())
    for broken in ({key: value for key, value in data.items() if key != "host"}, data | {"rank": "3"},
                   data | {"peer_lost": 0}, data | {"unknown": 1}, data | {"after": {"rank": 1}}, [data], None):
        assert FailureReport.from_dict(broken) is None, broken
    assert FailureReport.from_json("{not json") is None
    assert FailureReport.from_error_file_data({"message": "<NONE>"}) is None  # torchelastic's "no error file"


# Two ranks fail the way a worker does under cpctl launch (cpctl.runtime.process.report_failure):
# rank 0 first, having lost its peer; rank 1 after it, with its own error.
WRITE_REPORTS = """
import os, sys, time
from cpctl.runtime import process

for rank, error in (("0", RuntimeError("Connection closed by peer")), ("1", ValueError("batch 3 has no labels"))):
    os.environ |= {"RANK": rank, "TORCHELASTIC_ERROR_FILE": os.path.join(sys.argv[1], f"error{rank}.json")}
    try:
        raise error
    except Exception as exc:
        process.report_failure(exc, exc.__traceback__)
    time.sleep(0.05)
"""


@pytest.mark.full  # 2 workers failing
def test_the_launcher_names_the_root_cause_from_the_reports_workers_wrote(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_dir = tmp_path / "errors"
    done = subprocess.run([sys.executable, "-c", WRITE_REPORTS, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False,
                          env=launch_env(tmp_path) | {ERROR_DIR_ENV_VAR: str(error_dir)})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # what torchelastic's agent makes of each error file when the workers exit with code 1
    found = {rank: ProcessFailure(local_rank=rank, pid=4000 + rank, exitcode=1, error_file=str(tmp_path / f"error{rank}.json"))
             for rank in (0, 1)}
    error = failures.worker_failure(found)
    traceback_file = error_dir / "rank1-traceback.txt"
    assert str(error) == (f"rank 1: ValueError: batch 3 has no labels\n  traceback: {traceback_file}\n"
                          "  worker rank 1 (local rank 1, pid 4001) exited with code 1 (and 1 more rank after it)")
    assert error.exit_code == 1
    assert traceback_file.read_text().rstrip().endswith("ValueError: batch 3 has no labels")
    assert (error_dir / "rank0-traceback.txt").read_text().rstrip().endswith("RuntimeError: Connection closed by peer")
