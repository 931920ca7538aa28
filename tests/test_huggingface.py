"""A Hugging Face model with attn_implementation="sdpa" trains under CP unmodified (docs/huggingface.md).

transformers builds the model from a tiny config: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish

pytest.importorskip("transformers")


LAYOUTS = {
    "cp2": (("--nproc-per-node", "2", "--cp-size", "2"), 2, 1),
    # the model's own gradient checkpointing (cpctl's replaces it), backward after the context
    "cp2-checkpointing": (("--nproc-per-node", "2", "--cp-size", "2"), 2, 1),
    # the same at the selective level: attention's outputs kept, not recomputed
    "cp2-selective-checkpointing": (("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true",
                                     "--checkpoint-level", "selective"), 2, 1),
    # the decoder layers' MLPs in tiles of 8 tokens (a shard holds 32)
    "cp2-tiled-mlp": (("--nproc-per-node", "2", "--cp-size", "2", "--tiled-mlp-tokens", "8"), 2, 1),
    # tp: the model's own base_model_tp_plan ("colwise"/"rowwise") is the default plan
    "tp2": (("--nproc-per-node", "2", "--cp-size", "1", "--tp-size", "2"), 1, 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_llama_logits_and_gradients_equal_a_plain_step(tmp_path: Path, layout: str) -> None:
    flags, cp, tp = LAYOUTS[layout]
    out = tmp_path / "hf.json"
    extra = ["checkpointing"] if layout.endswith("checkpointing") else []
    code, stdout, stderr = finish(cpctl("--device", "cpu", *flags, str(REPO / "tests" / "workers" / "hf_cases.py"),
                                        str(out), *extra, tmp_path=tmp_path))
    assert code == 0, stdout + stderr
    result = json.loads(out.read_text())
    assert (result["cp"], result["tp"]) == (cp, tp) and result["n_params"] > 0
    assert result["checkpointed"] == layout.endswith("checkpointing")
    # engine calls in the step: one per layer and pass (forward; a full checkpoint's recompute)
    assert result["attention_calls"] == (4 if layout == "cp2-checkpointing" else 2 if cp > 1 else 0)
    assert result["tiled_mlps"] == (2 if layout.endswith("tiled-mlp") else 0)  # both layers' MLPs, or none
    assert result["logits"] <= 1e-5
    assert result["grads"] <= 1e-5
    if cp > 1:
        refusals = result["refusals"]
        for name, fragments in REFUSALS.items():
            assert refusals[name] is not None, f"{name} was not refused"
            for fragment in fragments:
                assert fragment in refusals[name], refusals[name]


REFUSALS = {
    "checkpointing_after_prepare": ["gradient_checkpointing_enable() after rt.prepare_model", "before prepare_model"],
    "padding_mask": ["attention_mask with left padding or holes", "pad on the right"],
    "use_cache": ["use_cache=False"],
    "num_items_in_batch": ["num_items_in_batch under context parallelism", "leave it out"],
    "labels_not_in_buffers": ["labels has the full sequence length 64", "add it to buffers"],
    "attention_dropout": ["attention_dropout=0.1", "set it to 0.0"],
}


def test_config_problems_name_the_setting() -> None:
    from types import SimpleNamespace

    from cpctl.integrations.huggingface import _config_problems

    assert list(_config_problems(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))) == []
    hybrid = list(_config_problems(SimpleNamespace(layer_types=["full_attention", "linear_attention"])))
    assert len(hybrid) == 1 and "'linear_attention'" in hybrid[0] and "cannot be sharded" in hybrid[0]
    capped = list(_config_problems(SimpleNamespace(attn_logit_softcapping=50.0)))
    assert len(capped) == 1 and "attn_logit_softcapping=50.0" in capped[0] and "set it to None" in capped[0]
