"""Hugging Face models under Ulysses (sp) and 2D (sp x cp), with the profile of `cpctl launch`, against one process.

tests/workers/ulysses_runtime_cases.py takes one training step per case (the model's own `.loss`
with positions it fills in, rt.causal_lm_loss, packed documents, a sliding window, one K/V
head replicated over the sp ranks) and gathers the evaluation logits; each layout is one run in
the session's pool of 4 CPU processes with gloo (tests/pool.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, launch_once, tiered

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "ulysses_runtime_cases.py"
TOLERANCE = 1e-5
LAYOUTS = {  # flags, then (cp, sp, dp)
    "sp4": (("--sp-size", "4"), (1, 4, 1)),
    "sp2-cp2": (("--sp-size", "2", "--cp-size", "2"), (2, 2, 1)),
    "sp2-cp2-alltoall": (("--sp-size", "2", "--cp-size", "2", "--cp-comm-strategy", "alltoall"), (2, 2, 1)),
    "sp2-dp_shard2": (("--sp-size", "2", "--dp-shard-size", "2"), (1, 2, 2)),
}
LAYOUT_PARAMS = tiered(LAYOUTS, quick={"sp2-cp2"})  # sp 2 x cp 2: Ulysses and CP in one launch
CASES = ("llama_loss", "llama_mqa", "llama_chunked_loss", "llama_packed", "mistral_window", "mistral_window_packed")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, pools):
    """layout -> the worker's results, from one run in the session's pool of 4 processes (tests/pool.py)."""

    def run(tmp: Path, layout: str) -> dict:
        out = tmp / "results.json"
        pools[4].run(WORKER, str(out), flags=LAYOUTS[layout][0], cwd=tmp)
        return json.loads(out.read_text())

    return launch_once(tmp_path_factory, "ulysses_runtime", run)


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_the_mesh_has_the_layout_asked_for(results, layout: str) -> None:
    sizes = results(layout)["sizes"]
    cp, sp, dp = LAYOUTS[layout][1]
    assert (sizes["cp"], sizes["sp"], sizes["dp"], sizes["seq"]) == (cp, sp, dp, cp * sp)
    assert sizes["mesh"] == ["dp_replicate", "dp_shard", "cp", "sp", "tp"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_a_step_equals_one_process(results, layout: str, case: str) -> None:
    errors = results(layout)[case]
    assert "crashed" not in errors, errors.get("crashed")
    assert sorted(errors) == ["grads", "logits", "loss"]
    assert errors["grads"] <= TOLERANCE and errors["logits"] <= 1e-5 and errors["loss"] <= 1e-5, errors


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_heads_and_lengths_that_do_not_divide_are_one_line_errors(results, layout: str) -> None:
    result = results(layout)
    cp, sp, _ = LAYOUTS[layout][1]
    assert result["refused_heads"] == (f"LlamaForCausalLM cannot run under context parallelism: sp_size {sp} splits "
                                       f"attention heads, but it has 5 attention heads; choose an sp_size that divides 5")
    # rt.shard of a length the layout does not divide (maybe_context_parallel would pad it): one line
    # naming the divisor and the fix. Outside any step that is the plain layout's divisor, also
    # right after a packed step placed by cost (its layout ended with it)
    message = result["refused_length"]
    divisor = f"2 * cp_size * sp_size ({2 * cp * sp}) with cp_load_balance" if cp > 1 else f"cp_size * sp_size ({sp})"
    assert message == (f"sequence length 63 is not divisible by {divisor}; pad the sequence to 64 tokens "
                       "or choose another cp_size or sp_size")
