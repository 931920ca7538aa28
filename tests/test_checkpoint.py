"""Checkpoints (cpctl.Checkpointer on torch.distributed.checkpoint) through real launches.

scripts/train_llama.py saves and resumes with --checkpoint-dir. A run stopped half-way at
cp 2 x dp_shard 2 (4 processes) resumes at cp 4 and in one plain process, and the resumed
steps' losses equal an uninterrupted run's; a checkpoint interrupted mid-write is never loaded;
`export` gives a single file a plain model loads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish, launch_env

SCRIPT = REPO / "scripts" / "train_llama.py"
STEPS, HALF = 6, 3
TOLERANCE = 1e-4  # fp32, as the layout tests of the example


def plain(tmp: Path, *args: str) -> dict:
    out = tmp / f"plain-{len(list(tmp.glob('plain-*')))}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", str(STEPS), *args, "--losses-out", str(out)],
                          cwd=tmp, env=launch_env(tmp), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def launched(tmp: Path, layout: list[str], *args: str) -> dict:
    out = tmp / f"launched-{len(list(tmp.glob('launched-*')))}.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", *layout, str(SCRIPT), "--steps", str(STEPS), *args,
                                        "--losses-out", str(out), tmp_path=tmp))
    assert code == 0, stdout + stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved_at_cp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An uninterrupted one-process reference, and a checkpoint of step 3 made at cp 2 x dp_shard 2."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    reference = plain(tmp)
    first = launched(tmp, ["--nproc-per-node", "4", "--cp-size", "2"], "--checkpoint-dir", str(tmp / "ckpt"),
                     "--save-every", str(HALF), "--stop-after", str(HALF))
    assert (first["cp"], first["dp"], len(first["losses"])) == (2, 2, HALF)
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(first["losses"], reference["losses"]))
    return tmp, reference


def resumed_equals_reference(resumed: dict, reference: dict) -> None:
    assert resumed["first_step"] == HALF
    assert len(resumed["losses"]) == STEPS - HALF
    for got, want in zip(resumed["losses"], reference["losses"][HALF:]):
        assert abs(got - want) <= TOLERANCE, (resumed["losses"], reference["losses"])


def test_a_checkpoint_saved_at_cp2_dp2_resumes_at_cp4(saved_at_cp2_dp2, tmp_path: Path) -> None:
    tmp, reference = saved_at_cp2_dp2
    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    resumed = launched(tmp_path, ["--nproc-per-node", "4", "--cp-size", "4"], "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert (resumed["cp"], resumed["dp"]) == (4, 1)
    resumed_equals_reference(resumed, reference)


def test_a_checkpoint_saved_at_cp2_dp2_resumes_in_one_process(saved_at_cp2_dp2, tmp_path: Path) -> None:
    tmp, reference = saved_at_cp2_dp2
    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    resumed_equals_reference(plain(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


def test_a_checkpoint_interrupted_mid_write_is_never_loaded(saved_at_cp2_dp2, tmp_path: Path) -> None:
    tmp, reference = saved_at_cp2_dp2
    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    # a later step whose writing was cut short: its files are there, its rename never happened
    shutil.copytree(tmp_path / "ckpt" / f"step-{HALF:09d}", tmp_path / "ckpt" / f"step-{HALF + 2:09d}.partial")
    (tmp_path / "ckpt" / f"step-{HALF + 2:09d}.partial" / ".metadata").write_bytes(b"torn")
    resumed_equals_reference(plain(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)


def test_export_gives_a_file_a_plain_model_loads(saved_at_cp2_dp2, tmp_path: Path) -> None:
    tmp, _ = saved_at_cp2_dp2
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO / "scripts")!r})
from cpctl.runtime.checkpoint import export
from llama import PRESETS, Llama
export({str(tmp / "ckpt" / f"step-{HALF:09d}")!r}, {str(tmp_path / "model.pt")!r})
model = Llama(PRESETS["tiny"])
missing, unexpected = model.load_state_dict(torch.load({str(tmp_path / "model.pt")!r}), strict=True)
print("loaded", sum(p.numel() for p in model.parameters()))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=launch_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "loaded 106816" in done.stdout, done.stdout + done.stderr


def test_an_asynchronous_checkpoint_resumes_like_a_blocking_one(saved_at_cp2_dp2, tmp_path: Path) -> None:
    _, reference = saved_at_cp2_dp2
    first = launched(tmp_path, ["--nproc-per-node", "2", "--cp-size", "2"], "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--save-every", str(HALF), "--stop-after", str(HALF), "--async-save")
    assert len(first["losses"]) == HALF and (tmp_path / "ckpt" / f"step-{HALF:09d}").is_dir()
    resumed_equals_reference(plain(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt")), reference)
