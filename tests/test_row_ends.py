"""Rows whose length the CP layout does not divide, and padded batches (docs/runtime.md).

One run of tests/workers/row_end_cases.py per size (cp 2; cp 1 and sp 2 x cp 2 in the full tier),
in the session's pool of processes of that size (tests/pool.py), runs every case; each compares a
step of a tiny Hugging Face Llama with the same step in one process on the full batch, at every
position (padding tokens included).
"""

from __future__ import annotations

import json

import pytest
from launching import REPO, tiered

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "row_end_cases.py"
TOLERANCE = 1e-5


# cp 2; in the full tier cp 1 (one process: transformers' own computation of padding must be
# matched there too; the engine's cases cover it in the quick tier) and Ulysses sp 2 x cp 2.
SIZES = {"cp1": ("1", []), "cp2": ("2", ["--cp-size", "2"]),
         "sp2-cp2": ("4", ["--cp-size", "2", "--sp-size", "2"])}


@pytest.fixture(scope="module", params=tiered(SIZES, quick={"cp2"}))
def cases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    procs, sizes = SIZES[request.param]
    tmp = tmp_path_factory.mktemp(f"row_ends_{request.param}")
    out = tmp / "results.json"
    pools.run(WORKER, str(out), flags=["--nproc-per-node", procs, *sizes], cwd=tmp)
    data = json.loads(out.read_text())
    assert data["cp"] * data["sp"] == int(procs)
    return data["cases"] | {"__seq_size__": int(procs)}


def result(cases: dict, name: str) -> dict:
    got = cases[name]
    if "crashed" in got:
        pytest.fail(f"case {name} crashed:\n{got['crashed']}")
    return got


def test_an_odd_length_is_padded_at_the_end_and_exact(cases) -> None:
    got = result(cases, "readme_loop_odd_length")
    ranks = cases["__seq_size__"]
    if ranks > 1:  # 63 tokens padded to 64 over 2 ranks (32 each), to 64 over 4 (16 each)
        assert got["local_len"] == 64 // ranks
    assert got["unsharded_shape"][1] == 63  # rt.unshard drops the padding
    assert got["restored"] == [2, 63] and got["restored_same"]  # a restored buffer is the caller's again
    assert got["logits"] <= TOLERANCE and got["grads"] <= TOLERANCE


def test_the_models_own_loss_on_an_odd_length(cases) -> None:
    got = result(cases, "model_loss_odd_length")
    assert got["loss"] <= TOLERANCE and got["grads"] <= TOLERANCE


PADDED = {
    "right_padding": "rows of 59 and 40 tokens, padded on the right",
    "left_padding": "the same rows padded on the left (whole shards of padding)",
    "holes": "zeros inside the mask, labels counting the padding tokens",
    "left_padding_with_positions": "left padding with generation's position ids",
}


@pytest.mark.parametrize("name", PADDED)
def test_a_padded_batch_equals_one_process_with_its_mask_at_every_position(cases, name: str) -> None:
    got = result(cases, name)
    assert got["loss"] <= TOLERANCE and got["grads"] <= TOLERANCE and got["logits"] <= TOLERANCE, got


def test_attention_that_is_not_causal_never_sees_the_appended_tokens(cases) -> None:
    assert result(cases, "bidirectional_padded")["out"] <= TOLERANCE


def test_packed_documents_on_an_odd_length(cases) -> None:
    got = result(cases, "packed_odd_length")
    assert got["logits"] <= TOLERANCE and got["grads"] <= TOLERANCE


def test_labels_that_would_count_the_padding_are_refused_or_padded_as_told(cases) -> None:
    got = result(cases, "pad_values_for_plain_labels")
    if cases["__seq_size__"] > 1:  # one rank appends nothing
        assert "rt.token_mean's loss counts the tokens appended at the end" in got["refused"]
        assert "pad_values" in got["refused"]
    assert got["grads"] <= TOLERANCE


REFUSALS = {
    "pad_values_length": ["1 buffers but 2 pad_values"],
    "shard_uneven": ["sequence length 7 is not divisible by"],
}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_padding_cannot_make_exact_is_refused(cases, name: str) -> None:
    if name == "shard_uneven" and cases["__seq_size__"] == 1:
        pytest.skip("one rank holds the whole sequence: nothing to divide")
    message = result(cases, "refusals")[name]
    assert message is not None, f"{name} was not refused"
    for fragment in REFUSALS[name]:
        assert fragment in message, message
