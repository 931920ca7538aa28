"""Pretrained weights in without a full copy per rank: `rt.from_pretrained` of a local bf16
checkpoint (several safetensors files, tied and untied heads) gives the checkpoint's weights
bit for bit (as fp32 master weights), its buffers, and the training of the way before it
(`from_pretrained` on every rank, then `rt.prepare_model`), in one process and at cp 2.
Bad checkpoints are one line. The host memory it saves is measured by scripts/bench_loading.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, error_lines, finish, start_python
from pool import Pools

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "load_cases.py"
TOLERANCE = 1e-5
ACCELERATE_CP2 = ("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "--script-api", "accelerate")


def checkpoint(tmp_path: Path, pools: Pools, *, tied: bool) -> Path:
    """A bf16 checkpoint in several safetensors files, written in one process (the session's pool of one)."""
    path = tmp_path / ("tied" if tied else "untied")
    pools[1].run(WORKER, str(path), "-", "--write-checkpoint", *(["--tied"] if tied else []), cwd=tmp_path)
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def assert_loaded_exactly(result: dict) -> None:
    assert result["names_differ"] == []
    assert result["largest_weight_difference"] == 0.0  # bit-equal: bf16 values are exact in fp32
    assert result["dtypes"] == ["torch.float32"]  # fp32 master weights from a bf16 checkpoint
    assert result["largest_buffer_difference"] == 0.0  # RoPE's inverse frequencies, computed, not loaded
    assert result["mode_after_loading"] == "eval"  # as from_pretrained returns it
    assert len(set(result["losses"])) == 2  # it trains
    for got, want in zip(result["losses"], result["losses_loaded_the_old_way"]):
        assert abs(got - want) <= TOLERANCE


@pytest.mark.full
def test_one_process_loads_the_checkpoint_exactly(tmp_path: Path, pools) -> None:
    out = tmp_path / "result.json"
    pools[1].run(WORKER, str(checkpoint(tmp_path, pools, tied=False)), str(out), cwd=tmp_path)
    assert_loaded_exactly(json.loads(out.read_text()))


def test_cp2_loads_a_tied_checkpoint_exactly(tmp_path: Path, pools) -> None:
    out = tmp_path / "result.json"
    pools[2].run(WORKER, str(checkpoint(tmp_path, pools, tied=True)), str(out), cwd=tmp_path,
                 flags=("--cp-size", "2", "--script-api", "cpctl"))
    assert_loaded_exactly(json.loads(out.read_text()))


def run_loading(tmp_path: Path, pools: Pools, path: Path, arguments: str = "", *, world: int = 1) -> str:
    """The last line of the traceback of rt.from_pretrained(path, arguments) on every rank of the
    session's pool of `world` (cp `world`)."""
    script = tmp_path / "load.py"
    script.write_text(f"import cpctl; from transformers import AutoModelForCausalLM; "
                      f"cpctl.init().from_pretrained(AutoModelForCausalLM, {str(path)!r}, {arguments})")
    outcome = pools[world].attempt(script, cwd=tmp_path, flags=("--cp-size", str(world)) if world > 1 else ())
    assert all(failure is not None for failure in outcome.failures), outcome.failures
    return outcome.failures[0].strip().splitlines()[-1]


def head_stored_twice(path: Path, *, equal: bool) -> None:
    """The untied checkpoint's head made the embedding's copy (`equal`), as a checkpoint of a tied
    model saved with torch.save holds it; otherwise left different."""
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    embedding = load_file(path / index["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    file = path / index["lm_head.weight"]
    weights = load_file(file)
    weights["lm_head.weight"] = embedding.clone() if equal else weights["lm_head.weight"]
    save_file(weights, file, metadata={"format": "pt"})


def test_a_config_that_ties_what_the_checkpoint_holds_as_two_weights_is_one_line(tmp_path: Path, pools) -> None:
    """transformers leaves such a tie undone (a warning): one shared tensor would silently hold
    whichever copy was read last."""
    path = checkpoint(tmp_path, pools, tied=False)
    line = run_loading(tmp_path, pools, path, "tie_word_embeddings=True", world=2)
    assert "the model's config ties lm_head.weight to model.embed_tokens.weight, but the checkpoint holds both " \
           "with different values" in line and "tie_word_embeddings=False" in line, line


@pytest.mark.full
def test_a_tie_the_checkpoint_holds_twice_with_equal_values_loads_tied(tmp_path: Path, pools) -> None:
    path = checkpoint(tmp_path, pools, tied=False)
    head_stored_twice(path, equal=True)
    out = tmp_path / "tied.json"
    script = tmp_path / "load.py"
    script.write_text(f"""import json, torch, cpctl
from transformers import AutoModelForCausalLM
rt = cpctl.init()
model = rt.from_pretrained(AutoModelForCausalLM, {str(path)!r}, tie_word_embeddings=True)
with torch.no_grad():
    logits = model(input_ids=torch.arange(16)[None]).logits
plain = AutoModelForCausalLM.from_pretrained({str(path)!r}, tie_word_embeddings=True, dtype=torch.float32)
with torch.no_grad():
    want = plain(input_ids=torch.arange(16)[None]).logits
if rt.is_main:
    json.dump({{"tied": model.lm_head.weight is model.model.embed_tokens.weight,
               "plain_tied": plain.lm_head.weight is plain.model.embed_tokens.weight,
               "difference": (logits - want).abs().max().item()}}, open({str(out)!r}, "w"))
""")
    pools[2].run(script, cwd=tmp_path, flags=("--cp-size", "2"))
    result = json.loads(out.read_text())
    assert result == {"tied": True, "plain_tied": True, "difference": result["difference"]}
    assert result["difference"] <= TOLERANCE


FP32_CHECKPOINT_IN_BF16 = """import json, sys, torch, torch.distributed as dist, cpctl
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
path, out = sys.argv[1:]
rt = cpctl.init()
if rt.is_main:  # an fp32 checkpoint
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path, max_shard_size="30KB")
dist.barrier()
streamed = rt.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16)
the_old_way = rt.prepare_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
def whole(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
got, want = whole(streamed), whole(the_old_way)
if rt.is_main:
    json.dump({"dtypes": sorted({str(t.dtype) for t in got.values()}),
               "largest_difference": max((got[k] - want[k]).abs().max().item() for k in want),
               "bf16_values": all(torch.equal(t, t.to(torch.bfloat16).float()) for t in got.values())}, open(out, "w"))
"""


@pytest.mark.full
def test_an_fp32_checkpoint_asked_for_in_bf16_loads_as_from_pretrained_rounds_it(tmp_path: Path, pools) -> None:
    """dtype=torch.bfloat16 rounds an fp32 checkpoint's values to bf16 in from_pretrained, which
    prepare_model's fp32 master weights then keep: rt.from_pretrained gives the same weights."""
    script, out = tmp_path / "fp32_in_bf16.py", tmp_path / "result.json"
    script.write_text(FP32_CHECKPOINT_IN_BF16)
    pools[2].run(script, str(tmp_path / "fp32"), str(out), cwd=tmp_path, flags=("--cp-size", "2"))
    assert json.loads(out.read_text()) == {"dtypes": ["torch.float32"], "largest_difference": 0.0, "bf16_values": True}


@pytest.mark.full
def test_a_checkpoint_of_another_shape_is_one_line(tmp_path: Path, pools) -> None:
    path = checkpoint(tmp_path, pools, tied=False)
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    file = path / index["weight_map"][name]
    weights = load_file(file)
    del weights[name]
    save_file(weights, file, metadata={"format": "pt"})
    line = run_loading(tmp_path, pools, path)
    assert "the checkpoint does not fit the model: 1 weights of the model are not in it" in line and name in line, line


def test_not_a_local_checkpoint_is_one_line(tmp_path: Path, pools) -> None:
    line = run_loading(tmp_path, pools, tmp_path / "meta-llama/Llama-3.2-1B")
    assert "not a local directory with .safetensors files; download the checkpoint first" in line, line


@pytest.mark.full
def test_an_accelerate_script_reads_the_checkpoint_on_rank_0_only_and_trains_as_one_process(tmp_path: Path,
                                                                                            pools) -> None:
    """`from_pretrained` on every rank, then `accelerator.prepare`: rank 1 holds empty parameters
    until accelerate's FSDP2 preparation sends it its shards from rank 0."""
    path = checkpoint(tmp_path, pools, tied=True)
    plain = tmp_path / "plain.json"
    one_process = start_python(str(WORKER), str(path), str(plain), "--accelerate", cwd=tmp_path)
    out = tmp_path / "result.json"
    pools.run(WORKER, str(path), str(out), "--accelerate", flags=ACCELERATE_CP2, cwd=tmp_path)
    one_process()
    result, reference = json.loads(out.read_text()), json.loads(plain.read_text())
    assert result["names_differ"] == [] and result["largest_weight_difference"] == 0.0
    assert result["dtypes"] == ["torch.float32"]  # fp32 master weights from the bf16 checkpoint
    assert result["ranks_that_read_the_weights"] == [0]
    assert len(set(result["losses"])) == 2
    for got, want in zip(result["losses"], reference["losses"]):
        assert abs(got - want) <= TOLERANCE


def accelerate_mistake(tmp_path: Path, pools: Pools, *, tied: bool, mistake: str) -> str:
    """The one error line of the accelerate way at cp 2 with `mistake` (a load_cases.py flag): a
    real launch, as the mistake is one rank's (its peer is left waiting, which would stop the pool)."""
    code, stdout, stderr = finish(cpctl(*ACCELERATE_CP2, str(WORKER), str(checkpoint(tmp_path, pools, tied=tied)),
                                        str(tmp_path / "out.json"), "--accelerate", mistake, tmp_path=tmp_path))
    assert code == 1, stdout + stderr
    (line,) = error_lines(stderr)
    return line


@pytest.mark.full
def test_a_model_called_before_accelerate_sends_its_weights_is_one_line(tmp_path: Path, pools) -> None:
    line = accelerate_mistake(tmp_path, pools, tied=True, mistake="--call-before-prepare")
    assert "rank 1" in line and "reads a checkpoint on rank 0 only" in line and "accelerator.prepare" in line, line


@pytest.mark.full
def test_an_accelerate_script_tying_what_the_checkpoint_holds_as_two_weights_is_one_line(tmp_path: Path,
                                                                                         pools) -> None:
    """Rank 1 builds the config's model, tie included, and accelerate ties it again: accelerate's
    own "FSDP2 mapping failed" at prepare before; now rank 0's line, at from_pretrained."""
    line = accelerate_mistake(tmp_path, pools, tied=False, mistake="--tie-word-embeddings")
    assert "rank 0" in line and "LlamaForCausalLM.from_pretrained(" in line and "tie_word_embeddings=False" in line, line


def test_an_argument_from_pretrained_would_not_take_is_one_line(tmp_path: Path, pools) -> None:
    line = run_loading(tmp_path, pools, checkpoint(tmp_path, pools, tied=False), "device_map='auto'")
    assert "device_map is neither an argument it takes" in line and "then rt.prepare_model" in line, line
