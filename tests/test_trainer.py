"""transformers' run_clm.py (in its own patterns: tests/workers/run_clm_pattern.py), unmodified,
under `cpctl launch --script-api accelerate` at cp 2 on CPU, against the same script in one process.

Blocks of 63 tokens (2 x cp = 4 does not divide them: every CP step pads at the end), training,
`--do_eval` with run_clm's accuracy (argmax predictions against the shifted labels) and
perplexity, and `trainer.predict`: the training losses, the evaluation's numbers and every
predicted token must be one process's. A probe (tests/startup/cp_probe.py) records that CP really ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from launching import REPO, cpctl, finish, probed, probed_env, start_python
from saved_models import largest_difference

pytest.importorskip("transformers")
pytest.importorskip("datasets")

SCRIPT = REPO / "tests" / "workers" / "run_clm_pattern.py"
CP2 = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--script-api", "accelerate")
TOLERANCE = 1e-4
STEPS = 3


def run_clm_args(hub: Path, output_dir: Path) -> list[str]:
    return ["--model_name_or_path", str(hub / "model"), "--train_file", str(hub / "clm" / "train.txt"),
            "--validation_file", str(hub / "clm" / "validation.txt"), "--block_size", "63", "--do_train", "--do_eval",
            "--do_predict", "--output_dir", str(output_dir), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--learning_rate", "0.01",
            "--lr_scheduler_type", "constant", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
            "--seed", "0", "--disable_tqdm", "true"]


def results(output_dir: Path) -> dict:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {"losses": [entry["loss"] for entry in state["log_history"] if "loss" in entry],
            "eval": json.loads((output_dir / "eval_results.json").read_text()),
            "predict": json.loads((output_dir / "predict_results.json").read_text()),
            "predictions": np.load(output_dir / "predictions.npy")}


@pytest.fixture(scope="module")
def run_clm(tmp_path_factory: pytest.TempPathFactory, tiny_hub: Path) -> dict:
    tmp = tmp_path_factory.mktemp("run_clm")
    plain = start_python(str(SCRIPT), *run_clm_args(tiny_hub, tmp / "plain"), cwd=tmp)
    code, out, err = finish(cpctl(*CP2, str(SCRIPT), *run_clm_args(tiny_hub, tmp / "cp"), tmp_path=tmp,
                                  env=probed_env(tmp)))
    assert code == 0, out + err
    plain()
    return {"plain": results(tmp / "plain"), "cp": results(tmp / "cp"), "probe": probed(tmp), "dirs": tmp}


def test_run_clm_trains_as_one_process(run_clm) -> None:
    want, got = run_clm["plain"]["losses"], run_clm["cp"]["losses"]
    assert len(want) == len(got) == STEPS and len(set(want)) == STEPS
    assert max(abs(a - b) for a, b in zip(want, got)) <= TOLERANCE, (got, want)


def test_run_clm_saves_the_model_one_process_trains(run_clm) -> None:
    """Its `trainer.save_model()` under FSDP (accelerate's default SHARDED_STATE_DICT) wrote nothing before."""
    dirs = run_clm["dirs"]
    assert largest_difference(dirs / "cp", dirs / "plain") <= TOLERANCE


def test_run_clm_evaluates_and_predicts_as_one_process(run_clm) -> None:
    """run_clm's default compute_metrics (argmax accuracy) needs predictions that line up with the
    labels: the CP ranks' logits are gathered back in token order before the metrics."""
    plain, cp = run_clm["plain"], run_clm["cp"]
    for key in ("eval_loss", "eval_accuracy", "perplexity"):
        assert abs(cp["eval"][key] - plain["eval"][key]) <= TOLERANCE * max(1.0, plain["eval"][key]), key
    assert cp["eval"]["eval_samples"] == plain["eval"]["eval_samples"]
    for key in ("test_loss", "test_accuracy"):
        assert abs(cp["predict"][key] - plain["predict"][key]) <= TOLERANCE, key
    assert cp["predictions"].shape == plain["predictions"].shape and cp["predictions"].shape[1] == 63
    assert np.array_equal(cp["predictions"], plain["predictions"])


def test_run_clm_ran_under_cp_on_half_of_each_padded_block(run_clm) -> None:
    for rank in run_clm["probe"]:
        assert rank["cp_size"] == 2
        steps = rank["steps"]
        assert len(steps) > STEPS  # training, then the evaluation's and the prediction's batches
        assert all(step["length"] == 63 and step["padded"] == 64 and step["local"] == 32 for step in steps)
        assert set(rank["attention_q_lens"]) == {32}
