"""The step-time model (`cpctl plan`'s step time, planner/timing.py) against every step time measured
on H200s (docs/benchmarks/*.jsonl), and what it must say of layouts whatever the figures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpctl import planner
from cpctl.errors import CpctlError
from cpctl.planner import hardware, timing
from cpctl.planner.setup import Setup

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "docs" / "benchmarks"
ONE_GPU, TWO_GPUS = 0.15, 0.20  # the bounds: one H200, two H200s
FIGURES = planner.H200
K = 1024


def _model(record: dict) -> planner.ModelShape:
    name = record.get("model") or record["preset"]
    if "hf_config" in record:
        return planner.model_from_hf_config(record["hf_config"], name=name)
    return planner.PRESETS[name.removeprefix("hf:")]


def _setup(record: dict) -> Setup:
    fields = {f.name for f in dataclasses.fields(Setup)}
    options = {name: value for name, value in record.items() if name in fields}
    if options.get("lora") is not None:
        options["lora"] = planner.Lora(**{**options["lora"], "targets": tuple(options["lora"]["targets"])})
    return dataclasses.replace(Setup(gpus=record["world"], cp=record["cp"], strategy=record["strategy"],
                                     sp=record.get("sp", 1)), **options)


def warm_step_runs():
    """Every training step timed on H200s by scripts/bench_train.py and bench_lora.py (cpctl's, not plain
    transformers'), except those whose time is not a warm step's: recorded with the allocator's history
    (memory_history) or as the process's first step (cold_start; timing_h200.jsonl has them warm)."""
    runs = []
    for path in sorted(BENCHMARKS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "step_s" not in record or record.get("system") == "plain" or "world" not in record:
                continue
            if record.get("memory_history") or record.get("cold_start"):
                continue
            runs.append(pytest.param(record, id=f"{path.stem}-{record.get('model', record.get('preset'))}-"
                                                f"{planner.format_tokens(record['seq'])}-w{record['world']}"))
    return runs


@pytest.mark.parametrize("record", warm_step_runs())
def test_recorded_step_times_as_predicted(record) -> None:
    """Each warm step measured on one H200 within 15% of the prediction, on two within 20%, with the
    options it ran with (train_h200x2.jsonl predates their recording: full checkpointing, full logits)."""
    if "activation_checkpointing" not in record:
        record = {**record, "activation_checkpointing": True}
    predicted = planner.predict(_model(record), _setup(record), record["seq"], FIGURES).total
    bound = ONE_GPU if record["world"] == 1 else TWO_GPUS
    assert abs(predicted - record["step_s"]) <= bound * record["step_s"], (predicted, record)


def test_enough_step_times_are_checked() -> None:
    runs = warm_step_runs()
    assert len(runs) >= 35
    assert sum(run.values[0]["world"] == 2 for run in runs) >= 4


def packed_runs():
    return [json.loads(line) for line in (BENCHMARKS / "packed_h200.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") in ("dense", "packed")]


@pytest.mark.parametrize("record", packed_runs(), ids=lambda r: r["kind"])
def test_packed_documents_as_predicted(record) -> None:
    """scripts/bench_packed.py: one 128k sequence, and 16 documents of 8k packed in it (chunked loss)."""
    documents = record["document"] if record["kind"] == "packed" else None
    setup = Setup(chunked_loss=True, loss_chunk_tokens=record["loss_chunk_tokens"])
    predicted = planner.predict(planner.PRESETS[record["model"]], setup, record["seq"], FIGURES,
                                document_tokens=documents).total
    assert abs(predicted - record["step_s"]) <= ONE_GPU * record["step_s"], (predicted, record)


def attention_runs():
    rows = [json.loads(line) for line in (BENCHMARKS / "attention_h200x2.jsonl").read_text().splitlines()]
    return [pytest.param(row, id=f"{row['engine']}-{row['strategy']}-{planner.format_tokens(row['seq'])}")
            for row in rows if row["engine"] in ("single", "cpctl")]


@pytest.mark.parametrize("row", attention_runs())
def test_recorded_attention_times_as_predicted(row) -> None:
    """scripts/bench_attention.py on one and two H200s: one layer's attention forward and backward."""
    shape = planner.ModelShape(name="attention", vocab_size=1, dim=row["heads"] * row["head_dim"], n_layers=1,
                               n_heads=row["heads"], n_kv_heads=row["kv_heads"], ffn_dim=1, head_dim=row["head_dim"])
    setup = Setup(gpus=row["world"], cp=row["world"], strategy=row["strategy"] or "allgather")
    predicted = 1000 * timing.attention_call_seconds(shape, setup, row["seq"], FIGURES)
    bound = ONE_GPU if row["world"] == 1 else TWO_GPUS
    assert abs(predicted - row["ms"]) <= bound * row["ms"], (predicted, row)


# ------------------------------------------------------------------------ what holds whatever the figures

LLAMA_8B = planner.PRESETS["llama-3.1-8b"]
CHECKPOINTED = Setup(activation_checkpointing=True, chunked_loss=True)


def step_s(setup: Setup, seq: int, model: planner.ModelShape = LLAMA_8B, **options) -> float:
    return planner.predict(model, setup, seq, FIGURES, **options).total


def test_recomputing_costs_time_and_selective_recomputes_less() -> None:
    none = step_s(dataclasses.replace(CHECKPOINTED, activation_checkpointing=False), 64 * K)
    full = step_s(CHECKPOINTED, 64 * K)
    selective = step_s(dataclasses.replace(CHECKPOINTED, checkpoint_level="selective"), 64 * K)
    assert none < selective < full


def test_mixed_is_faster_with_every_selective_block() -> None:
    """What lets checkpoint_level mixed take the most selective blocks that fit: each one saves time."""
    times = [step_s(dataclasses.replace(CHECKPOINTED, checkpoint_level="mixed", selective_blocks=count), 128 * K)
             for count in range(LLAMA_8B.n_layers + 1)]
    assert all(later < earlier for earlier, later in zip(times, times[1:], strict=False))


def test_packed_documents_cost_attention_only_inside_them() -> None:
    dense = planner.predict(LLAMA_8B, CHECKPOINTED, 128 * K, FIGURES)
    packed = planner.predict(LLAMA_8B, CHECKPOINTED, 128 * K, FIGURES, document_tokens=8 * K)
    assert packed.seconds["attention"] < dense.seconds["attention"] / 8
    assert packed.seconds["matmuls"] == dense.seconds["matmuls"]


def test_splitting_a_sequence_over_more_gpus_shortens_its_step() -> None:
    times = [step_s(CHECKPOINTED.with_cp(gpus), 512 * K) for gpus in (1, 2, 4, 8)]
    assert all(later < earlier for earlier, later in zip(times, times[1:], strict=False))


def test_a_ring_across_nodes_is_slower_over_a_slower_network() -> None:
    """32 GPUs in nodes of 8: the K/V exchange crosses the network, which a 1M-token step hides at 45 GB/s
    but not at 1 GB/s."""
    setup = dataclasses.replace(CHECKPOINTED.with_cp(32), gpus_per_node=8, strategy="alltoall")
    fast = planner.predict(LLAMA_8B, setup, 1024 * K, FIGURES)
    slow = planner.predict(LLAMA_8B, setup, 1024 * K, FIGURES.with_links(network_gbps=1.0))
    assert slow.total > fast.total
    assert slow.seconds["CP K/V, not hidden"] > 0


def test_ulysses_pays_its_all_to_alls() -> None:
    setup = dataclasses.replace(CHECKPOINTED, gpus=8, cp=1, sp=8, gpus_per_node=8)
    assert planner.predict(LLAMA_8B, setup, 256 * K, FIGURES).seconds["Ulysses all-to-all"] > 0
    assert "Ulysses all-to-all" not in planner.predict(LLAMA_8B, CHECKPOINTED.with_cp(8), 256 * K, FIGURES).seconds


def test_lora_trains_faster_than_full_fine_tuning() -> None:
    lora = dataclasses.replace(CHECKPOINTED, lora=planner.Lora(rank=16))
    assert step_s(lora, 32 * K) < step_s(CHECKPOINTED, 32 * K)


def test_the_ranking_lists_only_layouts_that_fit_fastest_first() -> None:
    setup = dataclasses.replace(CHECKPOINTED.with_cp(8), gpus_per_node=8)
    ranked = planner.rank_layouts(LLAMA_8B, setup, 1024 * K, FIGURES, gpu_memory_gib=141.0)
    assert ranked and all(entry.estimate.fits for entry in ranked)
    times = [entry.time.total for entry in ranked]
    assert times == sorted(times)
    assert {(entry.setup.sp, entry.setup.cp) for entry in ranked} >= {(1, 8), (8, 1)}
    # no checkpointing does not fit 1M on 8 GPUs: it is not offered
    assert all(entry.setup.activation_checkpointing for entry in ranked)


# ------------------------------------------------------------------------------------ figures and the CLI


def test_calibration_round_trips_through_its_cache(tmp_path: Path) -> None:
    path = hardware.save_calibration(planner.H100, tmp_path / "throughputs.json")
    assert hardware.load_calibration(path) == planner.H100


def test_a_damaged_calibration_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "throughputs.json"
    path.write_text("{\"name\": 1}")
    with pytest.raises(CpctlError, match="cpctl plan --calibrate again"):
        hardware.load_calibration(path)


def test_calibrating_measures_this_machine() -> None:
    """The calibration itself, on CPU at tiny sizes: real kernels timed, every figure positive."""
    from cpctl.planner.calibration import calibrate

    figures = calibrate("cpu", small=True)
    assert figures.matmul_tflops > 0 and figures.hbm_gbps > 0 and figures.host_adam_params_per_s > 0
    assert all(rate > 0 for rate in figures.attention_forward_tflops.values())
    assert all(rate > 0 for rate in figures.attention_backward_tflops.values())


def cpctl_plan(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpctl", "plan", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture
def plan_env(isolated: Path, tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "200"}


def test_plan_prints_the_step_time_and_the_layouts_by_time(plan_env) -> None:
    shown = cpctl_plan("--model", "llama-3.1-8b", "--seq-len", "1M", "--gpus", "8", "--activation-checkpointing",
                       "true", "--chunked-loss", env=plan_env)
    assert shown.returncode == 0, shown.stderr
    assert "step time" in shown.stdout and "layouts that fit, fastest first" in shown.stdout
    data = json.loads(cpctl_plan("--model", "llama-3.1-8b", "--seq-len", "1M", "--gpus", "8",
                                 "--activation-checkpointing", "true", "--chunked-loss", "--json", env=plan_env).stdout)
    assert data["time"]["step_s"] > 0 and data["throughputs"]["name"] == "NVIDIA H200"
    times = [entry["step_s"] for entry in data["layouts_by_time"]]
    assert times == sorted(times) and len(times) >= 4


def test_plan_uses_a_cached_calibration_and_says_whose(plan_env, tmp_path: Path) -> None:
    slower = dataclasses.replace(planner.H200, name="a slow GPU", source="calibrated", matmul_tflops=100.0)
    hardware.save_calibration(slower, tmp_path / "cache" / "cpctl" / "throughputs.json")
    args = ("--model", "llama-3.2-1b", "--seq-len", "32k", "--json")
    calibrated = json.loads(cpctl_plan(*args, env=plan_env).stdout)
    built_in = json.loads(cpctl_plan(*args, "--gpu", "h200", env=plan_env).stdout)
    assert calibrated["throughputs"]["name"] == "a slow GPU"
    assert calibrated["time"]["step_s"] > built_in["time"]["step_s"]


@pytest.mark.parametrize(("args", "says"), [
    (("--gpu", "a100"), "--gpu a100: cpctl knows h200, h100"),
    (("--gpu", "calibrated"), "no calibration in"),
    (("--network-gbps", "fast"), "--network-gbps"),
    (("--document-tokens", "0"), "--document-tokens"),
])
def test_bad_time_options_are_one_line(plan_env, args, says) -> None:
    shown = cpctl_plan("--model", "llama-3.2-1b", "--seq-len", "32k", *args, env=plan_env)
    assert shown.returncode == 2 and says in shown.stderr and "Traceback" not in shown.stderr


def test_calibrating_without_a_gpu_is_one_line(plan_env) -> None:
    shown = cpctl_plan("--calibrate", env={**plan_env, "CUDA_VISIBLE_DEVICES": ""})
    assert shown.returncode == 2 and "times a GPU and this machine has none" in shown.stderr


def test_a_tiled_mlp_recomputes_every_mlp_a_token_runs_through_dense_and_expert() -> None:
    """Tiling the MLP runs each tile's forward again in backward: the dense layers' MLPs of a mixture
    of experts as well as each token's top-k experts (they were counted as experts in every layer)."""
    moe = planner.ModelShape(name="moe", vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, head_dim=8,
                             experts=8, experts_per_token=2, expert_ffn_dim=16, dense_layers=1)
    dense_mlp, top_2_experts = 3 * 32 * 96, 2 * 3 * 32 * 16  # one dense layer; two MoE layers, 2 experts each
    assert moe.active_mlp_params == dense_mlp + 2 * top_2_experts
    plain, tiled = Setup(precision="no"), Setup(precision="no", tiled_mlp_tokens=16)
    sizes = {setup: planner.Sizes(moe, setup, 1024) for setup in (plain, tiled)}
    extra = timing._matmul_flops(sizes[tiled]) - timing._matmul_flops(sizes[plain])
    assert extra == 2 * (dense_mlp + 2 * top_2_experts) * 1024
