"""TRL's own `sft` script and its documented minimal example, unmodified, under `cpctl launch`.

`python -m trl.scripts.sft` runs against a tiny local hub (tests/workers/tiny_hub.py: a Llama,
a word-level tokenizer, jsonl texts of 20-60 words): once in one plain process, the reference,
and once under `cpctl launch --script-api accelerate` at cp 2 on CPU (gloo). The trainer's own
log (trainer_state.json) must agree: training losses, gradient norms, token accuracies and
entropies, and the evaluation's loss and metrics, run under CP too. A probe (tests/startup/cp_probe.py)
records what each rank's CP steps held, so the test knows CP really ran on half of each row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import cpctl, finish, probed, probed_env, start_python, started
from saved_models import largest_difference

pytest.importorskip("trl")
pytest.importorskip("datasets")

pytestmark = pytest.mark.full  # TRL's real sft script: slow to start

TOLERANCE = 1e-4
CP2 = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--script-api", "accelerate")
STEPS = 3
COMPARED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens",
            "eval_loss", "eval_entropy", "eval_mean_token_accuracy")


@pytest.fixture(scope="module")
def hub(tiny_hub: Path) -> Path:
    return tiny_hub


def sft_args(hub: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(hub / "model"), "--dataset_name", str(hub / "sft"),
            "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--learning_rate", "0.01", "--lr_scheduler_type", "constant",
            "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", str(STEPS), "--bf16", "false",
            "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0",
            "--save_strategy", "steps", "--save_steps", str(STEPS), *extra]


def logged(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]


def run_sft(tmp: Path, hub: Path, *extra: str) -> dict:
    """The sft script once in one process, once under cpctl at cp 2: both logs and the probe's records."""
    plain = start_python("-m", "trl.scripts.sft", *sft_args(hub, tmp / "plain", *extra), cwd=tmp)
    code, out, err = finish(cpctl(*CP2, "-m", "trl.scripts.sft", *sft_args(hub, tmp / "cp", *extra), tmp_path=tmp,
                                  env=probed_env(tmp)))
    assert code == 0, out + err
    plain()
    return {"plain": logged(tmp / "plain"), "cp": logged(tmp / "cp"), "probe": probed(tmp), "err": err, "dirs": tmp}


def assert_same_logs(run: dict) -> None:
    plain, cp = run["plain"], run["cp"]
    assert len(plain) == len(cp) == STEPS + 1  # each step, then the evaluation (saved before the summary)
    assert len({entry.get("loss") for entry in plain[:STEPS]}) == STEPS  # it trains: every step differs
    for step, (want, got) in enumerate(zip(plain, cp)):
        for key in COMPARED:
            if key in want:
                assert abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key])), (step, key, got[key], want[key])
    assert "eval_loss" in cp[STEPS]


def assert_cp_ran(run: dict, *, padded: bool) -> None:
    """Every rank sharded every step (training and evaluation) and attended over half of each row."""
    for rank in run["probe"]:
        assert rank["cp_size"] == 2 and len(rank["steps"]) >= STEPS + 1  # the evaluation's batches too
        assert set(rank["attention_q_lens"]) == {step["local"] for step in rank["steps"]}
        assert any(step["padded"] for step in rank["steps"]) == padded


@pytest.fixture(scope="module")
def default_collator(tmp_path_factory: pytest.TempPathFactory, hub: Path) -> dict:
    return run_sft(tmp_path_factory.mktemp("sft-default"), hub)


def test_sft_with_its_default_collator_equals_one_process(default_collator) -> None:
    """Right-padded batches of varying length (TRL's collator), some of a length 4 does not divide."""
    assert_same_logs(default_collator)
    assert_cp_ran(default_collator, padded=True)


def test_sft_saves_the_model_one_process_trains(default_collator) -> None:
    """The sft script's final `trainer.save_model` (and its checkpoint), in Hugging Face's format."""
    dirs = default_collator["dirs"]
    assert largest_difference(dirs / "cp", dirs / "plain") <= TOLERANCE
    assert largest_difference(dirs / "cp" / f"checkpoint-{STEPS}", dirs / "plain" / f"checkpoint-{STEPS}") <= TOLERANCE


def test_sft_packing_with_the_documented_cp_settings_equals_one_process(tmp_path: Path, hub: Path) -> None:
    """TRL refuses packing under CP itself; on cpctl's engine packed documents are exact.
    `pad_to_multiple_of 4` is what TRL's docs set for cp 2."""
    run = run_sft(tmp_path, hub, "--packing", "--max_length", "96", "--pad_to_multiple_of", "4")
    assert_same_logs(run)
    assert_cp_ran(run, padded=False)


def test_sft_with_a_peft_config_trains_and_saves_the_adapters_one_process_does(tmp_path: Path, hub: Path) -> None:
    """`--use_peft`: SFTTrainer(peft_config=...) wraps the model in LoRA adapters (every linear
    projection) itself, here with gradient checkpointing; the logs and the adapters it saves equal
    one process's."""
    from safetensors.torch import load_file

    # TRL's lora_dropout default (0.05) draws other masks on a shard than in one process: 0 to compare.
    # With gradient checkpointing, which TRL + LoRA + PyTorch's CP fail on (a CheckpointError).
    run = run_sft(tmp_path, hub, "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
                  "--lora_target_modules", "all-linear", "--gradient_checkpointing", "true")
    assert_same_logs(run)
    assert_cp_ran(run, padded=True)
    want = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    got = load_file(tmp_path / "cp" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and any("lora_B" in name for name in got)
    assert not (tmp_path / "cp" / "model.safetensors").exists()  # the adapters only, as peft saves them
    assert max((got[name] - want[name]).abs().max().item() for name in want) <= TOLERANCE


MINIMAL = """\
from datasets import load_dataset
from trl import SFTTrainer

dataset = load_dataset("{sft}", split="train")

trainer = SFTTrainer(
    model="{model}",
    train_dataset=dataset,
)
trainer.train()
"""


def test_the_documented_minimal_example_runs_with_its_bf16_default_only_when_the_launch_says_so(
        tmp_path: Path, hub: Path) -> None:
    """SFTConfig defaults to bf16 (and gradient checkpointing): on a CPU launch (fp32 by default)
    that is one line naming both; with --mixed-precision bf16 it trains on the CPU, under CP."""
    script = tmp_path / "minimal.py"
    script.write_text(MINIMAL.format(sft=hub / "sft", model=hub / "model"))
    (tmp_path / "fp32").mkdir()  # the refused launch's own directory: both run at once
    refused = cpctl(*CP2, str(script), tmp_path=tmp_path, cwd=tmp_path / "fp32")
    trained = started(cpctl(*CP2, "--mixed-precision", "bf16", str(script), tmp_path=tmp_path,
                            env=probed_env(tmp_path)))
    code, out, err = finish(refused)
    assert code == 1, out + err
    assert "the script's TrainingArguments set bf16=True (profile: fsdp.mixed_precision no)" in err
    assert "Traceback" not in err
    code, out, err = finish(trained)
    assert code == 0, out + err
    assert "'train_loss'" in out
    for rank in probed(tmp_path):
        assert rank["cp_size"] == 2 and rank["steps"]
        assert set(rank["attention_q_lens"]) == {step["local"] for step in rank["steps"]}
