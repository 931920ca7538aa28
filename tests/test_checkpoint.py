"""Checkpoints (cpctl.Checkpointer on torch.distributed.checkpoint) in real processes.

scripts/train_llama.py saves and resumes with --checkpoint-dir (in the session's pools of
processes, tests/pool.py; what the launcher reports of a fault, through real launches). A run
stopped half-way at cp 2 resumes in one process (and, in the full tier, one stopped at cp 2 x
dp_shard 2 on 4 processes resumes at cp 4 and in one process), and the resumed steps' losses
equal an uninterrupted one-process run's; a checkpoint interrupted mid-write is never loaded; a
damaged one is refused on every rank alike; `export` gives a single file a plain model loads.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import REPO, cpctl, error_lines, finish, launch_env
from pool import Pools

SCRIPT = REPO / "scripts" / "train_llama.py"
STEPS, HALF = 6, 3
TOLERANCE = 1e-4  # fp32, as the layout tests of the example
CP2 = ["--nproc-per-node", "2", "--cp-size", "2"]


def plain(tmp: Path, pools: Pools, *args: str) -> dict:
    """The example's losses file, trained in one process."""
    return trained(tmp, pools, ["--nproc-per-node", "1"], *args)


def trained(tmp: Path, pools: Pools, layout: list[str], *args: str) -> dict:
    """The example's losses file, trained in `layout` (the launcher is not what these tests test: the
    session's pools of processes run it, tests/pool.py)."""
    out = tmp / f"run-{len(list(tmp.glob('run-*')))}.json"
    pools.run(SCRIPT, "--steps", str(STEPS), *args, "--losses-out", str(out), flags=layout, cwd=tmp)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    """The example's losses file, uninterrupted, in one process."""
    return plain(tmp_path_factory.mktemp("reference"), pools)


@pytest.fixture(scope="module")
def saved_at_cp2_dp2(tmp_path_factory: pytest.TempPathFactory, pools, reference) -> tuple[Path, dict]:
    """A checkpoint of step 3 made at cp 2 x dp_shard 2, and the one-process reference."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    first = trained(tmp, pools, ["--nproc-per-node", "4", "--cp-size", "2"], "--checkpoint-dir", str(tmp / "ckpt"),
                    "--save-every", str(HALF), "--stop-after", str(HALF))
    assert (first["cp"], first["dp"], len(first["losses"])) == (2, 2, HALF)
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(first["losses"], reference["losses"]))
    return tmp, reference


@pytest.fixture(scope="module")
def saved_every_step(tmp_path_factory: pytest.TempPathFactory, pools, reference) -> Path:
    """Checkpoints of steps 1, 2 and 3, saved at cp 2 by a run with the reference's losses."""
    tmp = tmp_path_factory.mktemp("every_step")
    first = trained(tmp, pools, CP2, "--checkpoint-dir", str(tmp / "ckpt"), "--save-every", "1",
                    "--stop-after", str(HALF))
    assert [p.name for p in sorted((tmp / "ckpt").iterdir())] == [f"step-{n:09d}" for n in (1, 2, 3)]
    assert len(first["losses"]) == HALF
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(first["losses"], reference["losses"]))
    return tmp / "ckpt"


def resumed_equals_reference(resumed: dict, reference: dict) -> None:
    assert resumed["first_step"] == HALF
    assert len(resumed["losses"]) == STEPS - HALF
    for got, want in zip(resumed["losses"], reference["losses"][HALF:]):
        assert abs(got - want) <= TOLERANCE, (resumed["losses"], reference["losses"])


@pytest.mark.full
def test_a_checkpoint_saved_at_cp2_dp2_resumes_at_cp4(saved_at_cp2_dp2, pools, tmp_path: Path) -> None:
    tmp, reference = saved_at_cp2_dp2
    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    resumed = trained(tmp_path, pools, ["--nproc-per-node", "4", "--cp-size", "4"],
                      "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert (resumed["cp"], resumed["dp"]) == (4, 1)
    resumed_equals_reference(resumed, reference)


@pytest.mark.full
def test_a_checkpoint_saved_at_cp2_dp2_resumes_in_one_process(saved_at_cp2_dp2, pools, tmp_path: Path) -> None:
    tmp, reference = saved_at_cp2_dp2
    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    resumed_equals_reference(plain(tmp_path, pools, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


def test_a_checkpoint_saved_at_cp2_resumes_in_one_process(saved_every_step, reference, pools, tmp_path: Path) -> None:
    shutil.copytree(saved_every_step, tmp_path / "ckpt")
    resumed_equals_reference(plain(tmp_path, pools, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


def test_a_checkpoint_interrupted_mid_write_is_never_loaded(saved_every_step, reference, pools, tmp_path: Path) -> None:
    shutil.copytree(saved_every_step, tmp_path / "ckpt")
    # a later step whose writing was cut short: its files are there, its rename never happened
    shutil.copytree(tmp_path / "ckpt" / f"step-{HALF:09d}", tmp_path / "ckpt" / f"step-{HALF + 2:09d}.partial")
    (tmp_path / "ckpt" / f"step-{HALF + 2:09d}.partial" / ".metadata").write_bytes(b"torn")
    resumed_equals_reference(plain(tmp_path, pools, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


def test_export_gives_a_file_a_plain_model_loads(saved_every_step, tmp_path: Path, monkeypatch) -> None:
    """In this process: export reads the sharded files alone, with no process group."""
    import torch

    from cpctl.runtime.checkpoint import export

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from llama import PRESETS, Llama

    export(saved_every_step / f"step-{HALF:09d}", tmp_path / "model.pt")
    model = Llama(PRESETS["tiny"])
    model.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)  # every name, every shape
    assert sum(p.numel() for p in model.parameters()) == 106816


@pytest.mark.full
def test_an_asynchronous_checkpoint_resumes_like_a_blocking_one(saved_at_cp2_dp2, pools, tmp_path: Path) -> None:
    _, reference = saved_at_cp2_dp2
    first = trained(tmp_path, pools, ["--nproc-per-node", "2", "--cp-size", "2"],
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", str(HALF), "--stop-after", str(HALF),
                    "--async-save")
    assert len(first["losses"]) == HALF and (tmp_path / "ckpt" / f"step-{HALF:09d}").is_dir()
    resumed_equals_reference(plain(tmp_path, pools, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


# ----------------------------------------------------------------------------- faults

WORKER = REPO / "tests" / "workers" / "fault_worker.py"


def plain_run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """`python train_llama.py` in one process, its output kept (the resume says what it did on stderr)."""
    return subprocess.run([sys.executable, str(SCRIPT), "--steps", str(STEPS), *args], cwd=tmp, env=launch_env(tmp),
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_truncated_shard_in_the_latest_checkpoint_resumes_from_the_one_before(saved_every_step, reference,
                                                                                 tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_every_step, ckpt)
    shard = ckpt / f"step-{HALF:09d}" / "__1_0.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(1000)
    out = tmp_path / "losses.json"
    done = plain_run(tmp_path, "--checkpoint-dir", str(ckpt), "--losses-out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if "damaged" in line]
    assert len(said) == 1, done.stderr
    assert f"step-{HALF:09d}" in said[0] and "__1_0.distcp" in said[0] and "truncated" in said[0]
    assert f"resuming from step-{HALF - 1:09d}" in said[0]
    resumed = json.loads(out.read_text())
    assert resumed["first_step"] == HALF - 1
    for got, want in zip(resumed["losses"], reference["losses"][HALF - 1:]):
        assert abs(got - want) <= TOLERANCE, (resumed["losses"], reference["losses"])
    # set aside, never taken as latest again; the resumed run saved nothing (no --save-every)
    assert (ckpt / f"step-{HALF:09d}.damaged" / "__1_0.distcp").stat().st_size == 1000


def test_a_changed_byte_with_no_earlier_checkpoint_is_refused_on_every_rank_naming_the_file(
        saved_every_step, pools, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(saved_every_step / f"step-{HALF:09d}", ckpt / f"step-{HALF:09d}")
    shard = ckpt / f"step-{HALF:09d}" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: it would unpickle fine, and load a different model
    shard.write_bytes(bytes(data))
    outcome = pools[2].attempt(SCRIPT, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt), flags=CP2, cwd=tmp_path)
    for line in outcome.refusals():
        assert f"checkpoint {ckpt / f'step-{HALF:09d}'}: __0_0.distcp is damaged" in line and "checksum" in line, line
        assert "no earlier complete checkpoint" in line and f"move step-{HALF:09d} away" in line, line


def test_an_unwritable_checkpoint_directory_is_one_line(tmp_path: Path) -> None:
    """Through `cpctl launch`: every rank raises the same error, and the launch says it once."""
    (tmp_path / "a-file").write_text("")
    code, stdout, stderr = finish(cpctl("--device", "cpu", *CP2, str(SCRIPT), "--steps", "2", "--save-every", "1",
                                        "--checkpoint-dir", str(tmp_path / "a-file" / "ckpt"), tmp_path=tmp_path))
    assert code == 1, stdout + stderr
    (line,) = error_lines(stderr)
    assert "checkpoint step-000000001 in" in line and "cannot write there (Not a directory)" in line, line
    assert "Traceback" not in stdout + stderr


SMALL_DISK = """
set -e
mount -t tmpfs -o size={size}k tmpfs {disk}
set +e
{launch} > {tmp}/full.out 2> {tmp}/full.err
echo $? > {tmp}/full.code
ls -a {disk}/ckpt > {tmp}/full.ls
mount -o remount,size=64m {disk}
{launch} > {tmp}/resumed.out 2> {tmp}/resumed.err
echo $? > {tmp}/resumed.code
"""


@pytest.mark.full  # a checkpoint that cannot be written: the unwritable directory stays
def test_a_full_disk_is_one_line_and_the_latest_complete_checkpoint_stays(saved_at_cp2_dp2, tmp_path: Path) -> None:
    """A real small filesystem: a tmpfs, mounted in a private mount namespace (unshare)."""
    _, reference = saved_at_cp2_dp2
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("no unprivileged mount namespace here (unshare) to mount a small tmpfs in")
    disk = tmp_path / "disk"
    disk.mkdir()
    launch = shlex.join([sys.executable, "-m", "cpctl.launch.cli", "launch", "--device", "cpu", *CP2, str(SCRIPT),
                         "--steps", str(STEPS), "--save-every", "2", "--checkpoint-dir", str(disk / "ckpt"),
                         "--losses-out", str(tmp_path / "losses.json")])
    # room for one checkpoint of the tiny model (1.6 MB), not for two
    script = SMALL_DISK.format(size=2500, disk=disk, tmp=tmp_path, launch=launch)
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=tmp_path,
                   env=launch_env(tmp_path), timeout=300, check=True)
    full_err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.code").read_text().strip() == "1", full_err
    (line,) = error_lines(full_err)
    assert "checkpoint step-000000004" in line and "the disk is full" in line, line
    assert "the latest complete checkpoint is still step-000000002" in line, line
    assert "Traceback" not in full_err + (tmp_path / "full.out").read_text()
    # nothing half-written stays: the partial checkpoint was removed
    assert (tmp_path / "full.ls").read_text().split() == [".", "..", "step-000000002"]
    # with room again, the run resumes from step 2 and gives the uninterrupted run's losses
    assert (tmp_path / "resumed.code").read_text().strip() == "0", (tmp_path / "resumed.err").read_text()
    resumed = json.loads((tmp_path / "losses.json").read_text())
    assert resumed["first_step"] == 2
    for got, want in zip(resumed["losses"], reference["losses"][2:]):
        assert abs(got - want) <= TOLERANCE, (resumed["losses"], reference["losses"])


@pytest.mark.full
def test_kill_9_of_the_whole_job_during_a_save_resumes_from_the_last_complete_one(saved_at_cp2_dp2,
                                                                                   tmp_path: Path) -> None:
    _, reference = saved_at_cp2_dp2
    ckpt, pids = tmp_path / "ckpt", tmp_path / "pids"
    pids.mkdir()
    proc = cpctl("--device", "cpu", *CP2, str(WORKER), "train", str(pids), "--steps", str(STEPS), "--save-every", "1",
                 "--checkpoint-dir", str(ckpt), tmp_path=tmp_path)
    frozen = None
    deadline = time.monotonic() + 120
    while frozen is None and proc.poll() is None and time.monotonic() < deadline:
        writing = list(ckpt.glob("step-*.partial")) if ckpt.is_dir() else []
        saved = [p for p in ckpt.glob("step-*") if not p.name.endswith(".partial")] if writing else []
        if not saved or len(list(pids.glob("*.pid"))) < 2:  # a save after a complete one
            time.sleep(0.002)
            continue
        job = [proc.pid, *(int(p.read_text()) for p in pids.glob("*.pid"))]
        for pid in job:  # freeze the moment: the launcher and both ranks, mid-write
            os.kill(pid, signal.SIGSTOP)
        if writing[0].exists():
            frozen = job
        else:  # the save finished between seeing it and stopping: let it go on to the next one
            for pid in job:
                os.kill(pid, signal.SIGCONT)
    assert frozen is not None, "no save was caught in the middle"
    for pid in frozen:
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    partial = list(ckpt.glob("step-*.partial"))
    complete = [p for p in sorted(ckpt.iterdir()) if not p.name.endswith(".partial")]
    assert len(partial) == 1 and complete, sorted(p.name for p in ckpt.iterdir())
    last = int(complete[-1].name.removeprefix("step-"))
    assert int(partial[0].name.removeprefix("step-").removesuffix(".partial")) == last + 1
    out = tmp_path / "losses.json"
    done = plain_run(tmp_path, "--checkpoint-dir", str(ckpt), "--losses-out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = json.loads(out.read_text())
    assert resumed["first_step"] == last
    for got, want in zip(resumed["losses"], reference["losses"][last:]):
        assert abs(got - want) <= TOLERANCE, (resumed["losses"], reference["losses"])
