"""`cpctl plan`: the memory arithmetic against measured peaks, the fit rule against measured
out-of-memory runs, the model shapes, and the command (tables, --json, one-line errors, no torch).

Every measured number below is torch.cuda.max_memory_allocated of one training step on NVIDIA
H200s: bf16 FSDP2, activation checkpointing per block, AdamW, batch 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpctl import planner
from cpctl.launch.cli import app
from cpctl.errors import CpctlError
from cpctl.planner import PRESETS, Setup
from launching import REPO

K = 1024
AC = Setup(activation_checkpointing=True)
CHUNKED = dataclasses.replace(AC, chunked_loss=True)

# (model, sequence length, GPUs (all CP), options, measured peak GiB, where it was measured)
BENCH = "docs/benchmarks.md, scripts/bench_train.py"
HF = "transformers LlamaForCausalLM, full logits"
PROBE = "standalone FSDP2 harness, cpctl.runtime.losses' chunked loss (2026-12)"
MEMORY = "docs/benchmarks/memory_h200.jsonl (scripts/gpu_memory.sh)"
SELECTIVE = dataclasses.replace(AC, checkpoint_level="selective")
MODEL_LOSS = dataclasses.replace(AC, logits_kept=False)  # model(labels=...).loss
ALL_OPTIONS = dataclasses.replace(CHUNKED, tiled_mlp_tokens=8192, offload_activations=True)
FIRST = {"first_step": True}  # a length probed first in its process: no AdamW state yet in backward
CALIBRATION = [
    ("1b", 32 * K, 1, AC, 28.8, BENCH),
    ("1b", 64 * K, 1, AC, 45.0, BENCH),
    ("1b", 128 * K, 1, AC, 77.3, BENCH),
    ("1b", 192 * K, 1, AC, 109.7, BENCH),
    ("1b", 224 * K, 1, AC, 125.9, "scripts/bench_train.py --probe"),
    ("1b", 64 * K, 2, AC, 22.6, BENCH),
    ("1b", 128 * K, 2, AC, 38.8, BENCH),
    ("1b", 256 * K, 2, AC, 71.2, BENCH),
    ("1b", 384 * K, 2, AC, 103.5, BENCH),
    ("llama-3.2-1b", 32 * K, 1, AC, 71.7, HF),
    ("llama-3.2-3b", 48 * K, 1, AC, 127.9, HF),
    ("1b", 128 * K, 1, CHUNKED, 38.75, PROBE),
    ("1b", 256 * K, 1, CHUNKED, 64.58, PROBE),
    ("1b", 128 * K, 1, SELECTIVE, 97.59, MEMORY),
    ("1b", 128 * K, 1, CHUNKED, 39.25, MEMORY),
    ("1b", 128 * K, 1, dataclasses.replace(CHUNKED, checkpoint_level="selective"), 58.23, MEMORY),
    ("1b", 128 * K, 1, ALL_OPTIONS, 26.93, "docs/benchmarks/memory_1b_h200.txt"),
    ("1b", 384 * K, 1, dataclasses.replace(ALL_OPTIONS, **FIRST), 39.37, "docs/benchmarks/memory_1b_h200.txt"),
    ("1b", 768 * K, 1, dataclasses.replace(ALL_OPTIONS, **FIRST), 70.37, MEMORY),
    ("1b", 32 * K, 1, dataclasses.replace(AC, cpu_offload=True), 16.48, MEMORY),
    ("llama-3.2-1b", 32 * K, 1, MODEL_LOSS, 63.84, MEMORY),
    ("llama-3.2-1b", 64 * K, 1, MODEL_LOSS, 113.32, MEMORY),
    ("llama-3.2-3b", 48 * K, 1, MODEL_LOSS, 116.18, MEMORY),
    ("llama-3.2-1b", 32 * K, 1, ALL_OPTIONS, 23.93, MEMORY),
    ("llama-3.2-1b", 512 * K, 1, ALL_OPTIONS, 57.89, MEMORY),
    ("llama-3.2-3b", 32 * K, 1, dataclasses.replace(ALL_OPTIONS, **FIRST), 59.91, MEMORY),
]

# (model, sequence length, GPUs, options, trained on a 141 GiB H200?)
MEASURED_FIT = [
    ("1b", 224 * K, 1, AC, True),
    ("1b", 256 * K, 1, AC, False),
    ("1b", 384 * K, 2, AC, True),
    ("1b", 512 * K, 2, AC, False),
    ("llama-3.2-1b", 32 * K, 1, AC, True),
    ("llama-3.2-1b", 64 * K, 1, AC, False),
    ("llama-3.2-3b", 48 * K, 1, AC, True),
    ("llama-3.2-1b", 64 * K, 1, MODEL_LOSS, True),
    ("llama-3.2-3b", 64 * K, 1, MODEL_LOSS, False),
    ("1b", 768 * K, 1, ALL_OPTIONS, True),
    ("1b", 1024 * K, 1, ALL_OPTIONS, True),
    ("llama-3.2-3b", 512 * K, 1, dataclasses.replace(ALL_OPTIONS, logits_kept=False), True),
    ("llama-3.2-1b", 512 * K, 1, ALL_OPTIONS, True),
]


def options_label(setup: Setup) -> str:
    loss = "chunked loss" if setup.chunked_loss else "full logits" if setup.logits_kept else "model(labels).loss"
    extras = [setup.checkpoint_level] if setup.checkpoint_level != "full" else []
    extras += ["tiled MLP, activation offload"] if setup.offload_activations else []
    extras += ["cpu_offload"] if setup.cpu_offload else []
    extras += ["first step"] if setup.first_step else []
    return ", ".join([loss, *extras])


@pytest.mark.parametrize(("model", "seq", "gpus", "setup", "measured", "source"), CALIBRATION,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_predicted_peak_is_within_ten_percent_of_measured(model, seq, gpus, setup, measured, source) -> None:
    predicted = planner.peak_gib(PRESETS[model], setup.with_cp(gpus), seq)
    assert abs(predicted - measured) <= 0.10 * measured, (model, seq, gpus, predicted, measured, source)


def test_calibration_table() -> None:
    """The table docs/cli.md prints (run with -s to see it); every row within 10%."""
    rows = []
    for model, seq, gpus, setup, measured, _ in CALIBRATION:
        predicted = planner.peak_gib(PRESETS[model], setup.with_cp(gpus), seq)
        rows.append(f"| {model} | {gpus} | {planner.format_tokens(seq)} | {options_label(setup)} | {measured} | {predicted:.1f} | "
                    f"{100 * (predicted - measured) / measured:+.1f}% |")
        assert abs(predicted - measured) <= 0.10 * measured
    print("\n".join(rows))


def recorded_runs():
    """Every run scripts/bench_train.py recorded with its options (docs/benchmarks/*.jsonl)."""
    runs = []
    for path in sorted((REPO / "docs" / "benchmarks").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("peak_gib") and all(option in record for option in RECORDED_OPTIONS):
                runs.append(pytest.param(record, id=f"{path.stem}-{planner.format_tokens(record['seq'])}"))
    return runs


RECORDED_OPTIONS = ("activation_checkpointing", "checkpoint_level", "selective_blocks", "chunked_loss",
                    "tiled_mlp_tokens", "offload_activations", "cpu_offload", "logits_kept", "first_step")


@pytest.mark.parametrize("record", recorded_runs())
def test_recorded_runs_peak_as_planned(record) -> None:
    """Each recorded run's measured peak against today's planner, with the options it ran with
    (options a record predates are off, as they were)."""
    fields = {f.name for f in dataclasses.fields(Setup)}
    options = {name: value for name, value in record.items() if name in fields}
    if options.get("lora") is not None:  # a LoRA run (scripts/bench_lora.py) records its adapters' settings
        options["lora"] = planner.Lora(**{**options["lora"], "targets": tuple(options["lora"]["targets"])})
    setup = dataclasses.replace(Setup(gpus=record["world"], cp=record["cp"], strategy=record["strategy"],
                                      sp=record.get("sp", 1)), **options)
    # a model given as a config.json (scripts/bench_train.py --model hf:PATH) is recorded with its config
    model = (planner.model_from_hf_config(record["hf_config"], name=record["model"]) if "hf_config" in record
             else PRESETS[record["model"].removeprefix("hf:")])
    predicted = planner.peak_gib(model, setup, record["seq"])
    assert abs(predicted - record["peak_gib"]) <= 0.10 * record["peak_gib"], (predicted, record)
    if "host_gib" in record:
        host = planner.estimate(model, setup, record["seq"]).host_bytes
        assert abs(host / planner.GiB - record["host_gib"]) <= 0.10 * record["host_gib"], (host, record)


def test_some_runs_are_recorded_with_their_options() -> None:
    assert len(recorded_runs()) >= 3


@pytest.mark.parametrize(("model", "seq", "gpus", "setup", "trained"), MEASURED_FIT)
def test_fits_as_measured_on_an_h200(model, seq, gpus, setup, trained) -> None:
    assert planner.estimate(PRESETS[model], setup.with_cp(gpus), seq).fits is trained


def test_longest_sequence_lies_between_the_measured_ones() -> None:
    one, two = (planner.longest_fitting(PRESETS["1b"], AC.with_cp(gpus)) for gpus in (1, 2))
    assert 224 * K <= one < 256 * K
    assert 384 * K <= two < 512 * K
    assert planner.gpus_needed(PRESETS["1b"], AC, 256 * K).setup.gpus == 2


def test_more_gpus_hold_less_and_fit_longer() -> None:
    model = PRESETS["llama-3.1-8b"]
    peaks = [planner.peak_gib(model, CHUNKED.with_cp(gpus), 1024 * K) for gpus in (2, 4, 8, 16, 32)]
    assert peaks == sorted(peaks, reverse=True)
    longest = [planner.longest_fitting(model, CHUNKED.with_cp(gpus)) for gpus in planner.GPU_COUNTS]
    assert longest == sorted(longest) and longest[0] == 0 and longest[-1] > 4 * 1024 * K


def test_the_peak_moves_from_the_loss_to_the_blocks_when_the_loss_is_chunked() -> None:
    model = PRESETS["llama-3.2-3b"]
    full, chunked = (planner.estimate(model, setup, 128 * K) for setup in (AC, CHUNKED))
    assert full.peak_moment == "loss" and chunked.peak_moment == "mlp_backward"
    assert chunked.peak < full.peak / 2


def test_every_option_lowers_the_memory() -> None:
    model, seq = PRESETS["llama-3.2-1b"], 256 * K
    base = Setup(gpus=4, cp=4, activation_checkpointing=False, reshard_after_forward=False)
    before = planner.estimate(model, base, seq).peak
    for changes in ({"activation_checkpointing": True}, {"chunked_loss": True}, {"reshard_after_forward": True},
                    {"tiled_mlp_tokens": 8192}, {"offload_activations": True}, {"cpu_offload": True}):
        assert planner.estimate(model, dataclasses.replace(base, **changes), seq).peak < before, changes
    gathered = planner.estimate(model, AC.with_cp(16), 1024 * K)
    ring = planner.estimate(model, dataclasses.replace(AC.with_cp(16), strategy="alltoall"), 1024 * K)
    assert ring.total("attention_backward") < gathered.total("attention_backward")


def test_the_selective_level_keeps_attention_tensors_per_layer() -> None:
    model, seq = PRESETS["1b"], 128 * K
    full = planner.estimate(model, CHUNKED, seq)
    selective = planner.estimate(model, dataclasses.replace(CHUNKED, checkpoint_level="selective"), seq)
    # q, k, v, out in bf16 and an fp32 log-sum-exp per head, for every layer and token; the block
    # in backward no longer recomputes its own copy of them
    kept_per_layer = seq * (2 * (2 * model.q_dim + 2 * model.kv_dim) + 4 * model.n_heads)
    added = selective.total("mlp_backward") - full.total("mlp_backward")
    assert added == pytest.approx((model.n_layers - 1) * kept_per_layer, rel=1e-6)
    assert "--checkpoint-level full (slower)" in [s.what for s in planner.suggestions(
        planner.estimate(model, dataclasses.replace(CHUNKED, checkpoint_level="selective"), 1024 * K),
        available=planner.available_options())]


def test_offloaded_activations_take_host_memory_at_their_exact_size() -> None:
    # The Llama-3.2-3B shape at 384k was killed for host memory on a 128 GiB machine when PyTorch's
    # pinned allocator rounded each 2.25 GiB block input up to 4 GiB (112 GiB for 28 layers).
    # cpctl's arena takes each tensor at its size (tests/test_offload.py: the planner's count to
    # the byte on CPU): the block inputs, then the final norm's tensors and the ids.
    model, tokens = PRESETS["llama-3.2-3b"], 384 * K
    three = planner.estimate(model, ALL_OPTIONS, tokens)
    block_inputs = 28 * 2 * model.dim * tokens
    assert block_inputs == 28 * 2.25 * 2**30 and three.fits
    head = (4 * model.dim + 2 * model.dim + 4 + 16) * tokens  # fp32 norm input, normalized output, 1/rms, ids
    assert three.host_bytes == block_inputs + head
    one = PRESETS["1b"]
    assert planner.estimate(one, ALL_OPTIONS, 768 * K).host_bytes == (16 * 2 + 6) * one.dim * 768 * K + 20 * 768 * K
    assert planner.estimate(one, CHUNKED, 768 * K).host_bytes == 0
    # with the selective level each block's attention tensors go too
    selective = planner.estimate(one, dataclasses.replace(ALL_OPTIONS, checkpoint_level="selective"), 768 * K)
    kept = 2 * (2 * one.q_dim + 2 * one.kv_dim) + 4 * one.n_heads
    assert selective.host_bytes == planner.estimate(one, ALL_OPTIONS, 768 * K).host_bytes + 16 * kept * 768 * K
    offloaded = planner.estimate(one, dataclasses.replace(AC, cpu_offload=True), 32 * K)
    assert offloaded.host_bytes == pytest.approx(16 * one.params)


def test_advice_when_it_does_not_fit() -> None:
    result = planner.make_plan(PRESETS["1b"], AC, 256 * K)
    assert not result.estimate.fits
    by_what = {item.what: item.estimate for item in result.suggestions}
    assert by_what["a chunked loss: rt.causal_lm_loss (--chunked-loss here)"].fits
    assert by_what["2 GPUs, all on CP (--cp-size 2)"].fits
    assert planner.make_plan(PRESETS["1b"], AC, 64 * K).suggestions == []


# ----------------------------------------------------------------------------- models


def test_presets_are_the_example_models() -> None:
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from llama import PRESETS as EXAMPLE
    finally:
        sys.path.remove(str(REPO / "scripts"))
    for name, cfg in EXAMPLE.items():
        shape = PRESETS[name]
        assert (shape.vocab_size, shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_dim,
                shape.head_dim) == (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim,
                                    cfg.head_dim)


def test_parameter_counts() -> None:
    assert PRESETS["1b"].params == 1_104_218_112  # "1.10B parameters" (docs/benchmarks.md)
    assert PRESETS["llama-3.2-1b"].params == 1_235_814_400  # the published 1.24B
    assert PRESETS["llama-3.2-3b"].params == 3_212_749_824  # 3.21B
    assert PRESETS["llama-3.1-8b"].params == 8_030_261_248  # 8.03B


LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "tie_word_embeddings": True, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}


def test_a_hugging_face_config_reads_as_its_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    for spec in (tmp_path, tmp_path / "config.json"):
        shape = planner.load_model(str(spec))
        assert shape.weights_dtype == "bf16"  # its torch_dtype: what transformers loads it in
        assert dataclasses.replace(shape, name="llama-3.2-1b", weights_dtype=None) == PRESETS["llama-3.2-1b"]
    nested = {"model_type": "mllama", "text_config": {**LLAMA_32_1B, "num_key_value_heads": None, "head_dim": None}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    shape = planner.load_model(str(tmp_path))
    assert (shape.n_kv_heads, shape.head_dim, shape.dim) == (32, 64, 2048)


def test_master_weights_are_counted_in_the_dtype_the_runtime_keeps(tmp_path: Path) -> None:
    """The runtime upcasts a bf16 checkpoint's trainable weights to fp32 (fsdp.master_weights fp32):
    weights, gradients and AdamW's state at 4 bytes, as for an fp32 model; with keep they stay in
    the checkpoint's bf16, 2 bytes each, and compute runs in bf16 even with mixed_precision no."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_32_1B, "torch_dtype": None, "dtype": "bfloat16"}))
    bf16 = planner.load_model(str(tmp_path))
    assert bf16.weights_dtype == "bf16"  # transformers 5's key, as torch_dtype before it
    fp32 = dataclasses.replace(bf16, weights_dtype="fp32")
    gpus = dataclasses.replace(CHUNKED, gpus=8, cp=8)

    def at_step(model, setup) -> dict[str, float]:
        terms = planner.estimate(model, setup, 64 * K).terms
        return {term.name: term.at["optimizer_step"] for term in terms}

    shard = bf16.params / 8
    default = at_step(bf16, gpus)
    assert default == at_step(fp32, gpus)  # upcast: the same bytes as an fp32 checkpoint
    assert default["parameters"] == 4 * shard and default["gradients"] == 4 * shard
    assert default["optimizer state"] == 3 * 4 * shard  # two states and the foreach temporary
    keep = dataclasses.replace(gpus, master_weights="keep")
    kept = at_step(bf16, keep)
    assert kept["parameters"] == 2 * shard and kept["gradients"] == 2 * shard
    assert kept["optimizer state"] == 3 * 2 * shard
    assert at_step(fp32, keep) == default  # an fp32 checkpoint kept is fp32
    hows = {term.name: term.how for term in planner.estimate(bf16, keep, 64 * K).terms}
    assert hows["optimizer state"].startswith("AdamW, 2 bf16 states") and hows["parameters"].startswith("bf16, sharded")
    # mixed_precision no: fp32 compute for upcast weights, the weights' own bf16 for kept ones
    plain = dataclasses.replace(gpus, precision="no")
    assert planner.Sizes(bf16, plain, 64 * K).act == 4
    assert planner.Sizes(bf16, dataclasses.replace(plain, master_weights="keep"), 64 * K).act == 2
    assert planner.estimate(bf16, keep, 64 * K).peak < planner.estimate(bf16, gpus, 64 * K).peak


@pytest.mark.usefixtures("isolated")
def test_plan_reads_master_weights_from_the_profile(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    args = ("plan", "--model", str(tmp_path), "--seq-len", "64k", "--gpus", "8", "--json")
    default, keep = (json.loads(cpctl(*args, *extra).stdout)["estimate"] for extra in ((), ("--master-weights", "keep")))
    assert (default["setup"]["master_weights"], keep["setup"]["master_weights"]) == ("fp32", "keep")
    assert keep["peak_gib"] < default["peak_gib"]


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"hidden_size": 2048', "not valid JSON"),
    ("[1, 2]", "not a Hugging Face config.json"),
    ('{"hidden_size": 2048}', "no vocab_size"),
    (json.dumps({**LLAMA_32_1B, "num_hidden_layers": "16"}), "num_hidden_layers must be a positive integer"),
    # an encoder: by its model_type, or by its architectures' heads
    (json.dumps({**LLAMA_32_1B, "model_type": "bert", "architectures": None}),
     r"an encoder's config \(model_type bert\), not a decoder LM's"),
    (json.dumps({**LLAMA_32_1B, "model_type": "t5", "architectures": ["T5EncoderModel"]}),
     r"an encoder's config \(architectures T5EncoderModel\)"),
    (json.dumps({**LLAMA_32_1B, "model_type": "newthing", "architectures": ["NewThingForMaskedLM"]}),
     "an encoder's config"),
])
def test_bad_config_json(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(CpctlError, match=fragment):
        planner.load_model(str(path))


@pytest.mark.parametrize(("text", "tokens"), [
    ("4096", 4096), ("128k", 131072), ("128K", 131072), ("1M", 1048576), ("1.5M", 1572864), ("0.5k", 512),
    ("1_000", 1000),
])
def test_lengths(text: str, tokens: int) -> None:
    assert planner.parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "12q", "k", "-4k", "0", "0.3k", "1e6", "1.5"])
def test_bad_lengths(text: str) -> None:
    with pytest.raises(CpctlError, match="--seq-len"):
        planner.parse_tokens(text)


def test_format_tokens() -> None:
    assert [planner.format_tokens(n) for n in (4096, 229 * K, 2 * K * K, 1000)] == ["4k", "229k", "2M", "1,000"]


# ----------------------------------------------------------------------------- the command


def cpctl(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def one_line_error(result: object, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.usefixtures("isolated")
def test_plan_prints_the_terms_the_advice_and_the_scan() -> None:
    result = cpctl("plan", "--model", "1b", "--seq-len", "256k", "--device", "cuda", "--nproc-per-node", "1",
                   "--activation-checkpointing", "true")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("parameters", "gradients", "optimizer state", "activations for backward", "attention working set",
                 "MLP working set", "loss", "peak allocated", "allocator headroom", "CUDA/NCCL overhead",
                 "does not fit", "--chunked-loss", "--cp-size 2", "longest sequence that fits", "256k tokens need 2 GPUs"):
        assert text in out, text


@pytest.mark.usefixtures("isolated")
def test_plan_reads_at_80_columns_and_says_why_8_gpus() -> None:
    result = CliRunner().invoke(app, ["plan", "--model", "1b", "--seq-len", "128k"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    rows = {line.split("│")[0].strip(): line for line in lines if "│" in line}
    for term in ("parameters, gathered", "activations for backward", "attention working set", "+ allocator headroom"):
        assert term in rows, term  # one line per term, its name unbroken
    legend = next(index for index, line in enumerate(lines) if line.startswith("counted as"))
    assert lines[legend + 1].split()[:2] == ["parameters", "fp32,"]
    assert "needed 294.3 GiB of 141 GiB per GPU: does not fit" in result.stdout
    # no profile, no GPU here: the 8 GPUs are a stated assumption, with the flag that changes it
    assert ("profile as on a node with 8 GPUs (nproc_per_node auto and no GPU visible here: a node of 8 assumed; "
            "pass --nproc-per-node N for another)") in " ".join(result.stdout.split())


@pytest.mark.usefixtures("isolated")
def test_plan_json() -> None:
    result = cpctl("plan", "--model", "llama-3.2-3b", "--seq-len", "512k", "--chunked-loss", "--gpus", "8",
                   "--activation-checkpointing", "true", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["estimate"]["setup"]["cp"] == 8 and plan["estimate"]["local_tokens"] == 64 * K
    assert plan["estimate"]["fits"] is True and plan["suggestions"] == []
    assert [row["gpus"] for row in plan["longest"]] == list(planner.GPU_COUNTS)
    assert plan["profile"]["note"] == "--gpus 8: cp 8"
    total = plan["estimate"]["total_gib"][plan["estimate"]["peak_moment"]]
    assert total == pytest.approx(plan["estimate"]["peak_gib"], abs=1e-3)


@pytest.mark.usefixtures("isolated")
def test_plan_takes_profiles_as_check_does() -> None:
    result = cpctl("plan", "--model", "1b", "--seq-len", "1M", "--profile", "cp8-alltoall", "--json")
    assert result.exit_code == 0, result.output
    setup = json.loads(result.stdout)["estimate"]["setup"]
    assert (setup["gpus"], setup["cp"], setup["strategy"]) == (8, 8, "alltoall")


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize(("args", "fragments"), [
    (["--model", "2b", "--seq-len", "1k"], ["--model 2b: no such preset", "llama-3.2-1b"]),
    (["--model", "llama-3.2-1B", "--seq-len", "1k"], ["did you mean llama-3.2-1b?"]),
    (["--model", "missing/config.json", "--seq-len", "1k"], ["no such file"]),
    (["--model", "1b", "--seq-len", "12q"], ["--seq-len 12q: not a length"]),
    (["--model", "1b", "--seq-len", "0"], ["at least 1"]),
    (["--model", "1b"], ["--seq-len is required"]),
    (["--seq-len", "1k"], ["--model is required"]),
    (["--model", "1b", "--seq-len", "1k", "--gpus", "two"], ["--gpus two: not an integer"]),
    (["--model", "1b", "--seq-len", "1k", "--gpu-memory", "0"], ["--gpu-memory 0: must be at least 0.001"]),
    (["--model", "1b", "--seq-len", "1k", "--gpu-memory", "nan"], ["--gpu-memory nan: not a finite number"]),
    (["--model", "1b", "--seq-len", "1k", "--gpu-memory", "inf"], ["--gpu-memory inf: not a finite number"]),
    (["--model", "1b", "--seq-len", "1k", "--device", "cpu"], ["estimates GPU memory"]),
    (["--model", "1b", "--seq-len", "1k", "--cp-size", "3", "--nproc-per-node", "8"], ["does not divide world size 8"]),
])
def test_plan_errors_are_one_line(args: list[str], fragments: list[str]) -> None:
    one_line_error(cpctl("plan", *args), *fragments)


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize(("hub_id", "preset"), [
    ("meta-llama/Llama-3.2-1B", "llama-3.2-1b"),
    ("meta-llama/Llama-3.2-3B-Instruct", "llama-3.2-3b"),
    ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
])
def test_a_hub_id_of_a_presets_model_is_that_preset(hub_id: str, preset: str) -> None:
    result = cpctl("plan", "--model", hub_id, "--seq-len", "32k", "--json")
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    assert model["name"] == preset and model["vocab_size"] == 128256
    assert model["notes"] == [f"{hub_id} is not a file here; it has the shape of the preset {preset}, used here "
                              "(cpctl plan downloads nothing; for another model pass its config.json)"]
    one_line_error(cpctl("plan", "--model", "Qwen/Qwen2.5-Math-7B", "--seq-len", "1k"),
                   "--model Qwen/Qwen2.5-Math-7B: no such file", "cpctl plan downloads nothing",
                   "presets: tiny, 1b, llama-3.2-1b")


@pytest.mark.usefixtures("isolated")
def test_an_encoder_family_built_as_a_decoder_is_planned(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_32_1B, "model_type": "roberta", "architectures": None, "is_decoder": True}))
    assert planner.load_model(str(path)).n_layers == LLAMA_32_1B["num_hidden_layers"]


def test_unreadable_config_json(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"vocab_size": 128256,')
    one_line_error(cpctl("plan", "--model", str(bad), "--seq-len", "1k"), "not valid JSON", "line 1")
    bad.write_bytes(b"\xff\xfe{}")
    one_line_error(cpctl("plan", "--model", str(bad), "--seq-len", "1k"), "cannot read it")


_PROBE = """
import atexit, sys
atexit.register(lambda: sys.__stderr__.write("\\nTORCH=" + str("torch" in sys.modules) + "\\n"))
if sys.argv[1:] == ["import"]:
    import cpctl.planner
else:
    from cpctl.launch.cli import main
    sys.argv = ["cpctl", *sys.argv[1:]]
    main()
"""


@pytest.mark.parametrize("args", [["import"], ["plan", "--model", "1b", "--seq-len", "128k", "--device", "cuda"]],
                         ids=["import cpctl.planner", "cpctl plan"])
def test_the_planner_does_not_import_torch(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], check=False, capture_output=True, text=True,
                          timeout=60, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "TORCH=False", proc.stderr


def test_ulysses_layouts_in_the_plan() -> None:
    """sp 1 is the ring's plan term for term; Ulysses drops the gathered K/V of the whole sequence; the
    split keeps sp inside a node and dividing the heads, and says why."""
    model = PRESETS["llama-3.1-8b"]
    ring = CHUNKED.with_cp(8)
    assert planner.estimate(model, dataclasses.replace(ring, sp=1), 1024 * K).to_dict() == \
        planner.estimate(model, ring, 1024 * K).to_dict()
    ulysses = planner.estimate(model, CHUNKED.with_sp(8, 8), 1024 * K)
    assert ulysses.local_tokens == 128 * K and ulysses.to_dict()["setup"]["cp"] == 1
    gathered = planner.estimate(model, ring, 1024 * K)
    assert ulysses.total("attention_backward") < gathered.total("attention_backward")
    layout = planner.make_plan(model, CHUNKED.with_sp(16, 8), 1024 * K).layout
    assert (layout.sp, layout.cp) == (8, 2) and "8 GPUs" not in layout.reason and "across nodes" in layout.reason
    assert planner.make_plan(model, CHUNKED.with_cp(8), 64 * K).longest_sp[-1][1].sp == 8
    from cpctl.planner.layouts import choose_layout
    odd = dataclasses.replace(model, n_heads=12, n_kv_heads=2)
    assert (choose_layout(odd, seq_ranks=8).sp, choose_layout(odd, seq_ranks=8).cp) == (4, 2)
    assert "repeated 2x" in choose_layout(odd, seq_ranks=8).reason


@pytest.mark.usefixtures("isolated")
def test_planning_other_machines_does_not_judge_their_host_memory_by_this_one() -> None:
    """--gpus plans machines elsewhere: without --host-memory the host memory is said, not checked."""
    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "1M",
            "--cpu-offload", "true"]
    told = cpctl(*args)
    assert told.exit_code == 0, told.output
    line = next(line for line in told.stdout.splitlines() if line.startswith("host memory per machine"))
    assert line.endswith("GiB needed; not checked: the host's size is not known (--host-memory GIB)"), line
    assert "does not fit: host memory" not in told.stdout
    estimate = json.loads(cpctl(*args, "--json").stdout)["estimate"]
    assert estimate["host_memory_gib"] is None and estimate["fits_host"] is True
    checked = json.loads(cpctl(*args, "--host-memory", "4", "--json").stdout)["estimate"]
    assert checked["fits_host"] is False  # told the host's size, it is checked


@pytest.mark.usefixtures("isolated")
def test_plan_checks_host_memory_for_the_offload_options() -> None:
    args = ["plan", "--model", "llama-3.2-3b", "--seq-len", "512k", "--device", "cuda", "--nproc-per-node", "1",
            "--activation-checkpointing", "true", "--chunked-loss", "--tiled-mlp-tokens", "8192",
            "--offload-activations", "true"]
    roomy = json.loads(cpctl(*args, "--host-memory", "125", "--json").stdout)["estimate"]
    # 28 block inputs of 512k x 3072 bf16 (84 GiB) and the final norm's tensors, at their exact size
    assert roomy["host_gib"] == pytest.approx(93.0, abs=0.1) and roomy["fits_gpu"] and roomy["fits_host"]
    assert roomy["host_needed_gib"] == pytest.approx(roomy["host_gib"] + planner.WORKER_HOST_GIB, abs=1e-3)
    tight = cpctl(*args, "--host-memory", "64")
    assert tight.exit_code == 0, tight.output
    assert "does not fit: host memory" in tight.stdout and "of 64.0 GiB" in tight.stdout
    assert "--offload-activations false" in tight.stdout  # what to turn down, with what it needs of the GPU
    plan = json.loads(cpctl(*args, "--host-memory", "64", "--json").stdout)
    assert plan["estimate"]["fits"] is False and plan["estimate"]["fits_gpu"] is True
    turned_off = {s["what"]: s for s in plan["suggestions"]}["--offload-activations false (the activations on the GPU)"]
    assert turned_off["fits"] is False  # on the GPU the 3B shape's 512k do not fit either
    # the longest sequence that fits counts host memory too: less of it, shorter
    assert plan["longest"][0]["seq_len"] < json.loads(cpctl(*args, "--host-memory", "125", "--json").stdout)["longest"][0]["seq_len"]


@pytest.mark.usefixtures("isolated")
def test_plan_checks_host_memory_of_this_machine_by_default() -> None:
    from cpctl.launch.failures import machine_host_memory_gib

    result = cpctl("plan", "--model", "1b", "--seq-len", "128k", "--device", "cuda", "--nproc-per-node", "1",
                   "--activation-checkpointing", "true", "--offload-activations", "true", "--json")
    assert json.loads(result.stdout)["estimate"]["host_memory_gib"] == pytest.approx(machine_host_memory_gib())
    one_line_error(cpctl("plan", "--model", "1b", "--seq-len", "1k", "--host-memory", "none"), "--host-memory none")


def test_a_setup_built_directly_counts_host_memory_for_its_own_gpus() -> None:
    # Setup() is one GPU: the host holds one worker's offloaded tensors, not a node of 8
    model = PRESETS["llama-3.2-1b"]
    offload = dataclasses.replace(CHUNKED, tiled_mlp_tokens=8192, offload_activations=True)
    one = planner.estimate(model, offload, 64 * K)
    assert one.host_bytes > 0
    assert one.host_needed == pytest.approx(one.host_bytes + planner.WORKER_HOST_GIB * planner.GiB)
    four = planner.estimate(model, dataclasses.replace(offload, gpus=4, cp=4), 64 * K)
    assert four.host_needed == pytest.approx(4 * (four.host_bytes + planner.WORKER_HOST_GIB * planner.GiB))


def test_the_ulysses_scan_keeps_sp_inside_the_setups_machines() -> None:
    # machines of 4 GPUs: sp_size auto never splits heads across them, and neither does the plan's scan
    model = PRESETS["llama-3.1-8b"]
    nodes_of_4 = dataclasses.replace(CHUNKED.with_cp(4), gpus_per_node=4)
    plan = planner.make_plan(model, nodes_of_4, 1024 * K)
    splits = {gpus: (layout.sp, layout.cp) for gpus, layout, _ in plan.longest_sp}
    assert splits[4] == (4, 1) and splits[8] == (4, 2) and splits[32] == (4, 8)
    assert plan.needed_sp is not None and plan.needed_sp.setup.sp == 4


def test_the_model_key_names_the_planners_presets() -> None:
    from cpctl.config import KEYS

    assert KEYS["model"].allowed.startswith(f"a preset ({', '.join(PRESETS)}), ")


# ----------------------------------------------------------------------------- LoRA

# A Llama whose q, k/v, o and MLP projections all differ in shape (GQA, head_dim * heads != hidden_size),
# so that an adapter counted on the wrong side of a projection shows.
LORA_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24}
LLAMA_8B_R16_ADAPTERS = 41_943_040  # peft's print_trainable_parameters for Llama-3.1-8B, r=16, all-linear


@pytest.mark.parametrize(("rank", "targets"), [("8", "all-linear"), ("4", "q_proj,v_proj"), ("2", "o_proj,down_proj")])
def test_lora_adapters_are_the_parameters_peft_trains(rank: str, targets: str) -> None:
    """peft is the reference: what get_peft_model makes trainable is the planner's adapters, what it
    freezes is the model's parameters, and their bytes (a bf16 base, fp32 adapters: what get_peft_model
    makes of a bf16 model) are the plan's parameters on one GPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(**LORA_LLAMA, dtype="bfloat16")
    base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=int(rank), target_modules=(
        targets if targets == "all-linear" else targets.split(","))))
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]

    shape = planner.model_from_hf_config(config.to_dict(), name="tiny llama")
    setup = Setup(lora=planner.parse_lora(rank=rank, targets=targets))
    sizes = planner.Sizes(shape, setup, 1024)
    assert sizes.adapter_params == sum(p.numel() for p in trained)
    assert shape.params == sum(p.numel() for p in frozen)
    assert {p.dtype for p in trained} == {torch.float32} and {p.dtype for p in frozen} == {torch.bfloat16}
    assert sizes.base_dtype == "bf16"  # the config's dtype, as from_pretrained loads it
    parameters = planner.estimate(shape, setup, 1024).terms[0]
    assert parameters.name == "parameters"
    assert parameters.at["optimizer_step"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_lora_counts_the_frozen_base_as_weights_alone() -> None:
    """The frozen base: its weights in its own dtype, sharded as parameters are, no gradients, no AdamW
    state, no fp32 master copy; the adapters: fp32 weights, gradients and two AdamW states, even with
    master_weights keep (peft makes them fp32)."""
    model = PRESETS["llama-3.1-8b"]
    gpus = dataclasses.replace(CHUNKED, gpus=8, cp=8)

    def at_step(setup: Setup, shape: planner.ModelShape = model) -> dict[str, float]:
        return {term.name: term.at["optimizer_step"] for term in planner.estimate(shape, setup, 64 * K).terms}

    lora = dataclasses.replace(gpus, lora=planner.Lora(16, base_dtype="bf16"))
    assert planner.Sizes(model, lora, 64 * K).adapter_params == LLAMA_8B_R16_ADAPTERS
    base_shard, adapter_shard = model.params / 8, LLAMA_8B_R16_ADAPTERS / 8
    counted = at_step(lora)
    assert counted["parameters"] == 2 * base_shard + 4 * adapter_shard
    assert counted["gradients"] == 4 * adapter_shard
    assert counted["optimizer state"] == 3 * 4 * adapter_shard  # two states and the foreach temporary
    bf16_checkpoint = dataclasses.replace(model, weights_dtype="bf16")  # whose weights keep would train in bf16
    assert at_step(dataclasses.replace(lora, master_weights="keep"), bf16_checkpoint) == counted
    fp32_base = at_step(dataclasses.replace(gpus, lora=planner.Lora(16, base_dtype="fp32")))
    assert fp32_base["parameters"] == 4 * base_shard + 4 * adapter_shard
    full = at_step(gpus)
    state = ("parameters", "gradients", "optimizer state")
    assert sum(full[name] for name in state) == 20 * base_shard
    assert sum(counted[name] for name in state) < sum(full[name] for name in state) / 9
    # In the backward: no gradient for the frozen head, none for the frozen blocks
    backward = {term.name: term.at["mlp_backward"] for term in planner.estimate(model, lora, 64 * K).terms}
    assert backward["gradients"] == (2 + 4) * LLAMA_8B_R16_ADAPTERS / model.n_layers  # one block's adapters, bf16 + fp32


def test_the_frozen_base_dtype_is_the_models_unless_given(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))  # torch_dtype bfloat16
    from_config = planner.load_model(str(tmp_path))
    unsaid = PRESETS["llama-3.2-1b"]  # a preset names no dtype: fp32, as from_config builds it

    def base_dtype(model, lora) -> str:
        return planner.Sizes(model, Setup(lora=lora), 1024).base_dtype

    assert base_dtype(from_config, planner.Lora(8)) == "bf16" and base_dtype(unsaid, planner.Lora(8)) == "fp32"
    assert base_dtype(from_config, planner.Lora(8, base_dtype="fp32")) == "fp32"
    # mixed_precision no: the activations in the frozen weights' dtype
    plain = Setup(precision="no")
    assert planner.Sizes(from_config, dataclasses.replace(plain, lora=planner.Lora(8)), 1024).act == 2
    assert planner.Sizes(unsaid, dataclasses.replace(plain, lora=planner.Lora(8)), 1024).act == 4


def test_lora_keeps_its_own_tensors_for_backward() -> None:
    """Per token, each adapted projection keeps x @ A (rank values) for lora_B; with lora_dropout, also
    the dropped-out input lora_A keeps and dropout's 1-byte mask. The frozen base still needs every
    activation's gradient, so the rest is kept as in full fine-tuning; with checkpointing the adapters'
    tensors live in the recomputed block only, and the selective level recomputes them."""
    from cpctl.planner.terms import mlp_working_set, selective_kept_per_token

    model, tokens = PRESETS["llama-3.2-1b"], 8 * K

    def activations(setup: Setup) -> float:
        term = next(t for t in planner.estimate(model, setup, tokens).terms if t.name == "activations for backward")
        return term.at["loss"]

    saved = Setup(activation_checkpointing=False)  # every block's saved tensors counted
    lora, dropout = planner.Lora(16), planner.Lora(16, dropout=0.05)
    with_lora = activations(dataclasses.replace(saved, lora=lora))
    assert with_lora - activations(saved) == model.n_layers * tokens * 2 * 16 * 7  # bf16 x @ A on 7 projections
    inputs = 3 * model.dim + model.q_dim + 2 * model.dim + model.ffn_dim  # q, k, v; o; gate, up; down
    assert activations(dataclasses.replace(saved, lora=dropout)) - with_lora == model.n_layers * tokens * (2 + 1) * inputs
    only_q = activations(dataclasses.replace(saved, lora=planner.Lora(16, targets=("q_proj",))))
    assert only_q - activations(saved) == model.n_layers * tokens * 2 * 16

    checkpointed = Setup(activation_checkpointing=True)
    assert activations(dataclasses.replace(checkpointed, lora=dropout)) == activations(checkpointed)
    working = [mlp_working_set(planner.Sizes(model, setup, tokens)).at["mlp_backward"]
               for setup in (checkpointed, dataclasses.replace(checkpointed, lora=lora))]
    assert working[1] - working[0] == tokens * 2 * 16 * 3  # gate, up, down
    selective = dataclasses.replace(checkpointed, checkpoint_level="selective")
    assert (selective_kept_per_token(planner.Sizes(model, dataclasses.replace(selective, lora=lora), tokens))
            == selective_kept_per_token(planner.Sizes(model, selective, tokens)))


def test_lora_fits_the_8b_shape_on_one_gpu_where_full_fine_tuning_does_not() -> None:
    """Full fine-tuning of 8B parameters holds 20 bytes each on one GPU (fp32 weights, gradients, two
    AdamW states, the step's temporary): 150 GiB, no length fits 141. LoRA with a bf16 base holds 2."""
    model = PRESETS["llama-3.1-8b"]
    lora = dataclasses.replace(CHUNKED, lora=planner.Lora(16, base_dtype="bf16"))
    assert planner.longest_fitting(model, CHUNKED) == 0
    longest = planner.longest_fitting(model, lora)
    assert 200 * K < longest < 240 * K  # 218k (docs/cli.md)
    plan = planner.make_plan(model, lora, 32 * K)
    assert plan.longest[0] == (1, longest, None)  # the table's one-GPU row, with LoRA
    assert plan.lora_to_dict() == {"rank": 16, "targets": list(planner.PROJECTIONS), "dropout": 0.0,
                                   "base_dtype": "bf16", "adapter_params": LLAMA_8B_R16_ADAPTERS}


LORA_8B = ("plan", "--model", "llama-3.1-8b", "--seq-len", "32k", "--nproc-per-node", "1",
           "--activation-checkpointing", "true")


@pytest.mark.usefixtures("isolated")
def test_plan_with_lora_prints_the_adapters_and_the_frozen_base(tmp_path: Path) -> None:
    result = cpctl(*LORA_8B, "--chunked-loss", "--lora-rank", "16", "--base-dtype", "bf16")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert ("LoRA: 41.9M adapter parameters trained in fp32 (0.52% of the model), rank 16 on 7 projections x 32 "
            "blocks; the base frozen in bf16 (--base-dtype)") in out
    assert "LoRA r 16 on all-linear" in out and "frozen base bf16 (8.03B) + fp32 adapters (41.9M)" in out
    longest = planner.longest_fitting(PRESETS["llama-3.1-8b"], dataclasses.replace(
        CHUNKED, lora=planner.Lora(16, base_dtype="bf16")))
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("these options"))
    assert row.split("│")[1].strip() == planner.format_tokens(longest)

    lora, full = (json.loads(cpctl(*LORA_8B, *extra, "--json").stdout)
                  for extra in (("--lora-rank", "16", "--base-dtype", "bf16"), ()))
    assert lora["lora"]["adapter_params"] == LLAMA_8B_R16_ADAPTERS and full["lora"] is None
    assert lora["estimate"]["setup"]["lora"]["rank"] == 16
    assert lora["estimate"]["peak_gib"] < full["estimate"]["peak_gib"]
    assert lora["longest"][0]["seq_len"] > 0 == full["longest"][0]["seq_len"]
    targeted = json.loads(cpctl(*LORA_8B, "--lora-rank", "8", "--lora-targets", "v_proj, q_proj", "--json").stdout)
    assert targeted["lora"]["targets"] == ["q_proj", "v_proj"] and targeted["lora"]["base_dtype"] == "fp32"
    assert targeted["lora"]["adapter_params"] == 32 * 8 * (4096 + 4096 + 4096 + 1024)
    unsaid = CliRunner().invoke(app, [*LORA_8B, "--lora-rank", "8"], env={"COLUMNS": "80"}).stdout
    assert max(map(len, unsaid.splitlines())) <= 80
    assert ("the base frozen in fp32 (the model names no dtype, as from_config builds it; --base-dtype bf16"
            in " ".join(unsaid.split()))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))  # torch_dtype bfloat16
    said = cpctl("plan", "--model", str(tmp_path), "--seq-len", "32k", "--lora-rank", "16")
    assert said.exit_code == 0, said.output
    assert "the base frozen in bf16 (the model's config.json)" in " ".join(said.stdout.split())


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize(("args", "fragments"), [
    (["--lora-rank", "0"], ["--lora-rank 0: must be at least 1"]),
    (["--lora-rank", "-4"], ["--lora-rank -4: must be at least 1"]),
    (["--lora-rank", "2.5"], ["--lora-rank 2.5: not an integer"]),
    (["--lora-rank", "16", "--base-dtype", "fp8"], ["--base-dtype fp8: not a dtype", "bf16, fp16, fp32"]),
    (["--lora-rank", "16", "--lora-targets", "lm_head"], ["--lora-targets lm_head: no projection lm_head",
                                                          "all-linear", "q_proj,k_proj"]),
    (["--lora-rank", "16", "--lora-dropout", "1"], ["--lora-dropout 1: a probability below 1"]),
    (["--base-dtype", "bf16"], ["--base-dtype is a LoRA option: pass --lora-rank R"]),
    (["--lora-rank", "16", "--tp-size", "2", "--nproc-per-node", "2"], ["pass --tp-size 1"]),
])
def test_bad_lora_flags_are_one_line(args: list[str], fragments: list[str]) -> None:
    one_line_error(cpctl("plan", "--model", "llama-3.1-8b", "--seq-len", "32k", *args), *fragments)
