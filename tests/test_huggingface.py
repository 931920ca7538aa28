"""A Hugging Face model with attn_implementation="sdpa" trains under CP unmodified (SPEC section 3).

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
    # tp: the model's own base_model_tp_plan ("colwise"/"rowwise") is the default plan
    "tp2": (("--nproc-per-node", "2", "--cp-size", "1", "--tp-size", "2"), 1, 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_llama_logits_and_gradients_equal_a_plain_step(tmp_path: Path, layout: str) -> None:
    flags, cp, tp = LAYOUTS[layout]
    out = tmp_path / "hf.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", *flags, str(REPO / "tests" / "workers" / "hf_cases.py"),
                                        str(out), tmp_path=tmp_path))
    assert code == 0, stdout + stderr
    result = json.loads(out.read_text())
    assert (result["cp"], result["tp"]) == (cp, tp) and result["n_params"] > 0
    assert result["logits"] <= 1e-5
    assert result["grads"] <= 1e-5
