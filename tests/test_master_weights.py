"""Master weights in fp32 whatever dtype the weights arrive in (fsdp.master_weights).

transformers 5 loads a checkpoint in its own dtype (bf16 for the Llama releases). Kept as they
are, FSDP2 would shard bf16 parameters and AdamW keep bf16 states: updates below bf16's
resolution vanish. One plain process of tests/workers/master_weights_cases.py (a world of one)
measures a bf16 tiny Llama through rt.prepare_model; an accelerate script launched at cp 2 checks
the accelerate route. The profile key and its rule are checked without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO, TIMEOUT, launch_env

from cpctl.config import KEYS
from cpctl.config.rules import first_problem

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "master_weights_cases.py"
UPCAST = ("21 trainable parameters arrived in bf16; kept as fp32 master weights, with fp32 gradients and AdamW state "
          "(fsdp.master_weights: keep trains them in bf16)")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("master_weights")
    out = tmp / "results.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], cwd=tmp, env=launch_env(tmp),
                          check=False, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["world"], data["mixed_precision"]) == (1, "no")
    for name, result in data["cases"].items():
        if "crashed" in result:
            pytest.fail(f"case {name} crashed:\n{result['crashed']}")
    return data["cases"]


def test_the_key_is_fp32_by_default_and_keep_only_when_asked() -> None:
    key = KEYS["fsdp.master_weights"]
    assert (key.default, key.flag, key.env_var, key.spec.prompt) == ("fp32", "--master-weights", "CPCTL_MASTER_WEIGHTS", None)
    assert key.check("keep") and not key.check("bf16")


def test_a_bf16_model_trains_with_fp32_master_weights_and_states(cases) -> None:
    result = cases["fp32"]
    assert set(result["params"].values()) == {"float32"} and len(result["params"]) == 21
    assert set(result["params_after_step"].values()) == {"float32"}
    assert set(result["grads"].values()) == {"float32"} and result["states"] == ["float32"]
    assert result["logits"] == "float32"  # mixed_precision no: fp32 compute
    # as the bf16 weights upcast to fp32 train in one plain process
    assert result["grad_err"] <= 1e-5
    # a step of 1e-5 moves every weight: below bf16's resolution it would move few (the keep case)
    assert min(result["moved"].values()) > 0.99
    assert result["buffers"] == result["buffers_before"]  # buffers untouched (the rotary's, bf16)
    assert result["lines"] == [["INFO", UPCAST]]


def test_it_is_said_once_per_process(cases) -> None:
    assert cases["again"]["lines"] == [["DEBUG", UPCAST]]
    assert set(cases["again"]["params"].values()) == {"float32"}


def test_keep_trains_in_the_dtype_the_weights_arrived_in(cases) -> None:
    result = cases["keep"]
    assert set(result["params"].values()) == set(result["params_after_step"].values()) == {"bfloat16"}
    assert set(result["grads"].values()) == {"bfloat16"} and result["states"] == ["bfloat16"]
    assert result["logits"] == "bfloat16"
    # the updates fp32 master weights keep are mostly lost in bf16
    assert sum(result["moved"].values()) / len(result["moved"]) < 0.5
    assert result["lines"] == [["INFO", "21 trainable parameters arrived in bf16 and are trained in bf16 "
                                        "(fsdp.master_weights: keep): gradients and AdamW's state are bf16"]]


def test_frozen_parameters_keep_their_dtype(cases) -> None:
    result = cases["frozen"]
    assert result["params"].pop("model.embed_tokens.weight") == "bfloat16"
    assert set(result["params"].values()) == {"float32"}
    assert "model.embed_tokens.weight" not in result["grads"] and result["states"] == ["float32"]
    assert result["frozen_unchanged"] is True
    assert result["grad_err"] <= 1e-5  # as the trainable ones upcast, the frozen ones in bf16, train plainly
    assert result["lines"] == [["DEBUG", UPCAST.replace("21 trainable", "20 trainable")]]


def test_mixed_precision_computes_in_bf16_over_fp32_master_weights(cases) -> None:
    result = cases["bf16_compute"]
    assert set(result["params"].values()) == {"float32"} and result["states"] == ["float32"]
    assert result["logits"] == "bfloat16"  # FSDP2's MixedPrecisionPolicy gathers the parameters in bf16


@pytest.mark.parametrize(("values", "problem"), [
    ({"launch.script_api": "accelerate", "fsdp.mixed_precision": "bf16"}, "accelerate's FSDP2 preparation upcasts"),
    ({"launch.script_api": "accelerate", "fsdp.mixed_precision": "no"}, None),
    ({"launch.script_api": "cpctl", "fsdp.mixed_precision": "bf16"}, None),
])
def test_keep_under_accelerates_mixed_precision_is_refused(values: dict, problem: str | None) -> None:
    found = first_problem({"fsdp.master_weights": "keep", **values}, machine=None)
    assert (found is None) if problem is None else (problem in found), found


ACCELERATE_SCRIPT = """
import json, sys, torch
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, attn_implementation='sdpa', use_cache=False)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.model.embed_tokens.weight.requires_grad_(False)
accelerator = Accelerator(parallelism_config=ParallelismConfig())
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(128, (2, 64), generator=torch.Generator().manual_seed(1))
labels = ids.clone()
with accelerator.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}):
    accelerator.backward(model(input_ids=ids, labels=labels).loss)
optimizer.step()
dtypes = {name: str(p.dtype) for name, p in model.named_parameters()}
states = sorted({str(t.dtype) for s in optimizer.state.values() for t in s.values() if t.dim() > 0})
if accelerator.is_main_process:
    json.dump({"params": dtypes, "states": states}, open(sys.argv[1], "w"))
"""


@pytest.mark.full
def test_the_accelerate_route_has_fp32_master_weights(tmp_path: Path, pools) -> None:
    """accelerate upcasts only under its own mixed precision (on the CPU the profile's is no): cpctl
    does it before accelerate's FSDP2 preparation, frozen parameters left in bf16."""
    script, out = tmp_path / "bf16_accelerate.py", tmp_path / "dtypes.json"
    script.write_text(ACCELERATE_SCRIPT)
    pools.run(script, str(out), flags=("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2",
                                       "--script-api", "accelerate"), cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["params"].pop("model.embed_tokens.weight") == "torch.bfloat16"
    assert set(result["params"].values()) == {"torch.float32"} and result["states"] == ["torch.float32"]
