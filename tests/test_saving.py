"""The trained model out, in Hugging Face's format, from every route: saved by a sharded run,
reloaded in plain transformers in this one process, its logits equal the trained model's.

Routes (tests/workers/save_routes.py): cpctl's runtime (`model.save_pretrained`, a sharded save
with an index), accelerate (`accelerator.save_model`, `save_pretrained(state_dict=
accelerator.get_state_dict(model))`), the Trainer (`save_model`, its periodic checkpoints, both
FSDP_STATE_DICT_TYPEs, `resume_from_checkpoint`); TRL's trainers save through the Trainer's
`save_model` (tests/test_trl.py reloads what its sft script saved). Faults: a save called on rank 0
only, a directory that cannot be written, a write cut short: one line on every rank, the files
there before kept.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from launching import REPO, cpctl, error_lines, finish
from pool import Pools

pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

from cpctl.errors import CpctlError  # noqa: E402
from cpctl.runtime import saving  # noqa: E402

WORKER = REPO / "tests" / "workers" / "save_routes.py"
CPU2 = ("--device", "cpu", "--nproc-per-node", "2")
CP2 = (*CPU2, "--cp-size", "2")
TOLERANCE = 1e-5


def run_route(tmp_path: Path, pools: Pools, route: str, *extra: str, launch: tuple[str, ...] = CP2,
              env: dict | None = None) -> Path:
    """The route's worker as `cpctl launch LAUNCH` runs it, in the session's pool of its process
    count (tests/pool.py: for the accelerate and Trainer routes, accelerate's variables and
    cpctl's shim as `--script-api accelerate` gives them; the launcher is not what these test);
    returns its output directory."""
    out = tmp_path / route
    api = "cpctl" if route == "runtime" else "accelerate"
    pools.run(WORKER, route, str(out), *extra, flags=(*launch, "--script-api", api), cwd=tmp_path, env=env)
    return out


def reloaded_logits(directory: Path) -> torch.Tensor:
    from save_routes import PROBE

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def assert_reloads_as_trained(directory: Path, out: Path) -> None:
    trained = torch.load(out / "logits.pt")
    got = reloaded_logits(directory)
    assert (got - trained).abs().max().item() <= TOLERANCE
    assert not [p.name for p in directory.parent.iterdir() if ".partial-" in p.name]  # no staging left behind


@pytest.fixture(autouse=True)
def workers_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "workers"))


def test_the_runtime_route_saves_sharded_files_that_reload_as_trained(tmp_path: Path, pools) -> None:
    out = run_route(tmp_path, pools, "runtime")
    model = out / "model"
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in model.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (model / "model.safetensors").exists()
    assert_reloads_as_trained(model, out)


@pytest.mark.full
def test_one_process_saves_what_it_trained(tmp_path: Path, pools) -> None:
    """cp 1 in one process: the model prepare_model sharded over a world of one."""
    out = run_route(tmp_path, pools, "runtime", launch=("--nproc-per-node", "1"))
    assert_reloads_as_trained(out / "model", out)


@pytest.mark.full
def test_a_save_under_ulysses_reloads_as_trained(tmp_path: Path, pools) -> None:
    out = run_route(tmp_path, pools, "runtime", launch=(*CPU2, "--sp-size", "2", "--cp-size", "1"))
    assert_reloads_as_trained(out / "model", out)


@pytest.mark.full
def test_a_save_at_cp2_x_dp_shard2_reloads_as_trained(tmp_path: Path, pools) -> None:
    out = run_route(tmp_path, pools, "runtime", launch=("--nproc-per-node", "4", "--cp-size", "2", "--dp-shard-size", "2"))
    assert_reloads_as_trained(out / "model", out)


@pytest.fixture(scope="module")
def accelerate_four_steps(tmp_path_factory: pytest.TempPathFactory, pools) -> Path:
    """The accelerate route at cp 2 for four steps, uninterrupted, its state saved at step 2 (the
    model at step 4 saved each way): read by the tests of its saves and, copied, resumed."""
    return run_route(tmp_path_factory.mktemp("accelerate"), pools, "accelerate", "--steps", "4")


@pytest.mark.full
def test_accelerates_three_ways_to_save_reload_as_trained(accelerate_four_steps: Path) -> None:
    out = accelerate_four_steps
    assert_reloads_as_trained(out / "unwrapped", out)  # save_pretrained(state_dict=accelerator.get_state_dict(model))
    assert_reloads_as_trained(out / "main-only", out)  # the same under `if accelerator.is_main_process:`
    trained = torch.load(out / "logits.pt")
    from safetensors.torch import load_file

    model = LlamaForCausalLM.from_pretrained(out / "unwrapped", dtype=torch.float32)
    model.load_state_dict(load_file(out / "model" / "model.safetensors"))  # accelerator.save_model: weights only
    from save_routes import PROBE

    with torch.no_grad():
        assert (model.eval()(input_ids=PROBE).logits - trained).abs().max().item() <= TOLERANCE


@pytest.mark.full
def test_accelerates_save_state_resumes_as_an_uninterrupted_run(accelerate_four_steps: Path, tmp_path: Path,
                                                                 pools) -> None:
    """accelerator.save_state at step 2, load_state in a new run, steps 3-4: the model the
    uninterrupted four-step run trained (on the CPU route accelerate once wrote a format it could
    not load back). The resumed run checkpoints activations, the first did not: the state's
    names are the model's own either way."""
    assert (accelerate_four_steps / "state" / "pytorch_model_fsdp_0").is_dir()  # accelerate's FSDP format: sharded
    shutil.copytree(accelerate_four_steps / "state", tmp_path / "accelerate" / "state")
    resumed = run_route(tmp_path, pools, "accelerate", "--steps", "4", "--resume",
                        launch=(*CP2, "--activation-checkpointing", "true"))
    assert_reloads_as_trained(resumed / "unwrapped", accelerate_four_steps)


@pytest.fixture(scope="module")
def trainer_four_steps(tmp_path_factory: pytest.TempPathFactory, pools) -> Path:
    """The Trainer route at cp 2 for four steps, uninterrupted (its checkpoints at steps 2 and 4,
    its saved model): read by the tests of its format and, copied, resumed."""
    return run_route(tmp_path_factory.mktemp("trainer"), pools, "trainer", "--steps", "4")


@pytest.mark.full
def test_the_trainer_saves_its_model_and_checkpoints_in_hugging_faces_format(trainer_four_steps: Path) -> None:
    """FSDP_STATE_DICT_TYPE unset (accelerate's default: SHARDED_STATE_DICT), where save_model wrote nothing."""
    out = trainer_four_steps
    assert_reloads_as_trained(out / "model", out)
    checkpoint = out / "run" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "config.json").is_file()
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir()  # the Trainer's own resume files, beside


@pytest.mark.full
def test_the_trainer_with_full_state_dict_saves_as_trained(tmp_path: Path, pools) -> None:
    out = run_route(tmp_path, pools, "trainer", env={"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"})
    assert_reloads_as_trained(out / "model", out)


@pytest.mark.full
def test_the_trainer_resumed_from_its_checkpoint_saves_what_an_uninterrupted_run_would(trainer_four_steps: Path,
                                                                                         tmp_path: Path,
                                                                                         pools) -> None:
    checkpoint = tmp_path / "trainer" / "run" / "checkpoint-2"
    shutil.copytree(trainer_four_steps / "run" / "checkpoint-2", checkpoint)  # only what an interrupted run had
    resumed = run_route(tmp_path, pools, "trainer", "--steps", "4", "--resume")
    assert (checkpoint.parent / "checkpoint-4").is_dir()
    assert_reloads_as_trained(resumed / "model", trainer_four_steps)


@pytest.mark.full
def test_a_save_called_on_rank_0_only_is_one_line_not_a_hang(tmp_path: Path) -> None:
    code, stdout, stderr = finish(cpctl(*CP2, "--comm-timeout", "5", "--script-api", "cpctl",
                                        str(WORKER), "runtime", str(tmp_path / "out"), "--main-only",
                                        tmp_path=tmp_path))
    assert code == 1, stdout + stderr
    (line,) = error_lines(stderr)
    assert "save_pretrained gathers the sharded weights from every rank" in line and "1 of 2" in line, line
    assert "call it on every rank" in line and "Traceback" not in stdout + stderr


@pytest.mark.full
def test_an_unwritable_directory_is_one_line_on_every_rank(tmp_path: Path, pools) -> None:
    (tmp_path / "a-file").write_text("")
    outcome = pools[2].attempt(WORKER, "runtime", str(tmp_path / "out"), "--into", str(tmp_path / "a-file" / "model"),
                               flags=(*CP2, "--script-api", "cpctl"), cwd=tmp_path)
    for line in outcome.refusals():  # the same error on every rank: the launcher's one line
        assert "saving the model" in line and "cannot write there (Not a directory)" in line, line


# ---------------------------------------------------------------- the write itself, in this process


def old_save(directory: Path) -> dict[str, str]:
    directory.mkdir()
    files = {"config.json": "{}", "model.safetensors": "old weights", "tokenizer.json": "mine"}
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def test_a_write_cut_short_leaves_the_files_there_before(tmp_path: Path) -> None:
    target = tmp_path / "model"
    before = old_save(target)

    def fills_the_disk(staging: Path) -> None:
        (staging / "model-00001-of-00002.safetensors").write_text("new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CpctlError) as caught:
        saving.write_together(target, fills_the_disk, what="saving the model")
    message = str(caught.value)
    assert "the disk is full (No space left on device" in message and "the files there before are as they were" in message
    assert {p.name: p.read_text() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the staging directory is gone


def test_a_sharded_save_replaces_the_older_unsharded_weights_and_keeps_other_files(tmp_path: Path) -> None:
    target = tmp_path / "model"
    old_save(target)

    def sharded(staging: Path) -> None:
        for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"):
            (staging / name).write_text("new")

    saving.write_together(target, sharded, what="saving the model")
    fresh = saving.write_together(tmp_path / "fresh", sharded, what="saving the model")
    assert fresh.stat().st_mode & 0o777 == 0o777 & ~current_umask()  # a new directory as mkdir makes it
    assert {p.name: p.read_text() for p in target.iterdir()} == {
        "config.json": "new", "model-00001-of-00002.safetensors": "new", "model-00002-of-00002.safetensors": "new",
        "model.safetensors.index.json": "new", "tokenizer.json": "mine"}


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
