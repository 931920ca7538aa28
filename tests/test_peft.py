"""LoRA (peft) under cpctl: `get_peft_model` before `rt.prepare_model`, adapters on every linear
projection, trained at cp 2 (full tier: cp 1, sp 2 x cp 2, each checkpointing level, tiled MLPs;
one process through cpctl's runtime; the Trainer) against one plain process with peft: the same
losses and adapter gradients (1e-5, fp32), no gradient for a frozen weight; the adapters saved
with `save_pretrained` reload in plain peft with the trained model's logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launching import REPO, start_python, tiered
from pool import Pools

pytest.importorskip("peft")

WORKER = REPO / "tests" / "workers" / "peft_cases.py"
CP2 = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2")
ACCELERATE_CP2 = (*CP2, "--script-api", "accelerate")  # the Trainer's route (the pool runs it as cpctl launch does)
TOLERANCE = 1e-5


def run_alone(pools: Pools, tmp_path: Path, out: Path, *extra: str) -> dict:
    """The worker in one process: the session's pool of one (tests/pool.py)."""
    pools[1].run(WORKER, str(out), *extra, cwd=tmp_path)
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    tmp = tmp_path_factory.mktemp("peft-plain")
    return run_alone(pools, tmp, tmp / "plain", "--plain")


def assert_same_training(got: dict, want: dict) -> None:
    assert len(set(want["losses"])) == 2  # it trains
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOLERANCE
    for step_got, step_want in zip(got["gradients"], want["gradients"]):
        assert step_got.keys() == step_want.keys() and any("lora_A" in name for name in step_got)
        for name in step_want:
            largest = (torch.tensor(step_got[name]) - torch.tensor(step_want[name])).abs().max().item()
            assert largest <= TOLERANCE, name


def assert_adapters_reload(out: Path) -> None:
    from peft import PeftModel

    sys.path.insert(0, str(WORKER.parent))
    try:
        from peft_cases import PROBE, base_model
    finally:
        sys.path.pop(0)
    model = PeftModel.from_pretrained(base_model(), out / "adapters").eval()
    with torch.no_grad():
        assert (model(input_ids=PROBE).logits - torch.load(out / "logits.pt")).abs().max().item() <= TOLERANCE


# Layouts and checkpointing levels a LoRA run is launched with; cp 2 in the quick tier.
CHECKPOINTING = ("--activation-checkpointing", "true", "--checkpoint-level")
LAYOUTS = {
    "cp2": CP2,
    "cp1": ("--device", "cpu", "--nproc-per-node", "1"),
    "sp2-cp2": ("--device", "cpu", "--nproc-per-node", "4", "--cp-size", "2", "--sp-size", "2"),
    "cp2-full-checkpointing": (*CP2, *CHECKPOINTING, "full"),
    "cp2-selective-checkpointing": (*CP2, *CHECKPOINTING, "selective"),
    "cp2-mixed-checkpointing-tiled": (*CP2, *CHECKPOINTING, "mixed", "--selective-blocks", "1", "--tiled-mlp-tokens", "8",
                                      "--tiled-norm-tokens", "8"),
}


def run_layout(tmp_path: Path, pools: Pools, flags: tuple[str, ...], *extra: str) -> dict:
    """The worker's run with `flags`, in the session's pool of their process count (tests/pool.py)."""
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "out"
    pools.run(WORKER, str(out), *extra, flags=(*flags, "--script-api", "cpctl"), cwd=tmp_path)
    return json.loads((out / "result.json").read_text()) | {"out": out}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick={"cp2"}))
def test_lora_trains_and_saves_as_one_process(tmp_path: Path, pools, reference: dict, layout: str) -> None:
    result = run_layout(tmp_path, pools, LAYOUTS[layout])
    assert_same_training(result, reference)
    assert result["frozen_dtypes"] == ["torch.float32"]
    assert result["frozen_with_grads"] == 0  # FSDP2 makes no gradient (so no optimizer state) for frozen weights
    assert_adapters_reload(result["out"])


@pytest.mark.full
def test_lora_dropout_is_recomputed_with_the_forwards_masks(tmp_path: Path, pools) -> None:
    """Dropout draws other masks under CP than in one process; a checkpointed block's recompute must
    draw the forward's again, so checkpointing changes no gradient."""
    plain = run_layout(tmp_path / "plain", pools, CP2, "--dropout", "0.3")
    checkpointed = run_layout(tmp_path / "checkpointed", pools, (*CP2, *CHECKPOINTING, "full"), "--dropout", "0.3")
    assert_same_training(checkpointed, plain)


@pytest.mark.full
def test_lora_through_the_runtime_in_one_process_trains_and_saves_as_peft(tmp_path: Path, pools,
                                                                           reference: dict) -> None:
    out = tmp_path / "one"
    assert_same_training(run_alone(pools, tmp_path, out), reference)
    assert_adapters_reload(out)


@pytest.mark.full
def test_lora_on_a_bf16_base_keeps_the_base_bf16_and_trains_fp32_adapters(tmp_path: Path, pools,
                                                                            reference: dict) -> None:
    result = run_layout(tmp_path, pools, CP2, "--bf16-base")
    out = result["out"]
    assert result["frozen_dtypes"] == ["torch.bfloat16"] and result["trainable_dtypes"] == ["torch.float32"]
    for got, want in zip(result["losses"], reference["losses"]):  # a bf16 base: bf16's tolerance
        assert abs(got - want) <= 2e-2 * max(1.0, abs(want))
    assert_adapters_reload_close(out)


def assert_adapters_reload_close(out: Path) -> None:
    """The saved adapters are the trained ones, in fp32, and load in plain peft."""
    from peft import PeftModel
    from safetensors.torch import load_file

    saved = load_file(out / "adapters" / "adapter_model.safetensors")
    assert saved and all(tensor.dtype == torch.float32 for tensor in saved.values())
    assert any("lora_B" in name and tensor.abs().max() > 0 for name, tensor in saved.items())  # trained: B left 0
    sys.path.insert(0, str(WORKER.parent))
    try:
        from peft_cases import base_model
    finally:
        sys.path.pop(0)
    PeftModel.from_pretrained(base_model(), out / "adapters")


@pytest.mark.full
def test_get_peft_model_after_prepare_model_is_refused_on_every_rank_before_any_step(tmp_path: Path, pools) -> None:
    """Its adapters would be neither sharded nor reduced: each rank would train its own copy."""
    outcome = pools[2].attempt(WORKER, str(tmp_path / "out"), "--peft-after-prepare",
                               flags=(*CP2, "--script-api", "cpctl"), cwd=tmp_path)
    for line in outcome.refusals():
        assert "28 parameters were added to the model after rt.prepare_model" in line and "lora_A" in line, line
        assert "get_peft_model(model, config), then rt.prepare_model" in line, line


@pytest.mark.full
def test_a_trainer_with_a_peft_model_under_cp2_trains_and_saves_as_one_process(tmp_path: Path, pools) -> None:
    from safetensors.torch import load_file

    one_process = start_python(str(WORKER), str(tmp_path / "plain"), "--trainer", cwd=tmp_path)
    out = tmp_path / "cp2"
    pools.run(WORKER, str(out), "--trainer", flags=ACCELERATE_CP2, cwd=tmp_path)
    one_process()
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())
    got = json.loads((out / "result.json").read_text())
    assert len(got["losses"]) == 2 and all(abs(a - b) <= TOLERANCE for a, b in zip(got["losses"], plain["losses"]))
    want = load_file(tmp_path / "plain" / "adapters" / "adapter_model.safetensors")
    saved = load_file(out / "adapters" / "adapter_model.safetensors")
    assert saved.keys() == want.keys() and any("lora_B" in name for name in saved)
    assert max((saved[name] - want[name]).abs().max().item() for name in want) <= TOLERANCE


@pytest.mark.full
def test_a_lora_trainer_with_checkpointing_resumed_from_its_checkpoint_trains_as_uninterrupted(tmp_path: Path,
                                                                                               pools) -> None:
    """A LoRA run's Trainer checkpoint holds its adapters (peft names them as the model without
    cpctl's checkpoint wrappers has them), and resuming reads them: the steps after the checkpoint
    and the saved adapters are the uninterrupted one-process run's."""
    from safetensors.torch import load_file

    trainer = ("--trainer", "--steps", "4", "--checkpointing")
    one_process = start_python(str(WORKER), str(tmp_path / "plain"), *trainer, cwd=tmp_path)
    out = tmp_path / "cp2"
    for step in (("--stop-at", "2"), ("--stop-at", "2", "--resume")):  # an interrupted run, then a new one
        pools.run(WORKER, str(out), *trainer, *step, flags=ACCELERATE_CP2, cwd=tmp_path)
    saved_state = list((out / "run" / "checkpoint-2" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert saved_state and sum(path.stat().st_size for path in saved_state) > 1000  # the adapters, not nothing
    one_process()
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())["losses"]
    resumed = json.loads((out / "result.json").read_text())["losses"]  # steps 3 and 4
    assert len(plain) == 4 and len(resumed) == 2
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(resumed, plain[2:])), (resumed, plain)
    want = load_file(tmp_path / "plain" / "adapters" / "adapter_model.safetensors")
    saved = load_file(out / "adapters" / "adapter_model.safetensors")
    assert saved.keys() == want.keys()
    assert max((saved[name] - want[name]).abs().max().item() for name in want) <= TOLERANCE
