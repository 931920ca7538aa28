"""Rows whose length the CP layout does not divide, and right-padded batches (docs/runtime.md).

One `cpctl launch` at cp 2 of tests/workers/row_end_cases.py runs every case; each compares a
CP step of a tiny Hugging Face Llama with the same step in one process on the full batch.
"""

from __future__ import annotations

import json

import pytest
from launching import REPO, cpctl, finish

pytest.importorskip("transformers")

WORKER = REPO / "tests" / "workers" / "row_end_cases.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("row_ends")
    out = tmp / "results.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", str(WORKER),
                                        str(out), tmp_path=tmp))
    assert code == 0, stdout + stderr
    data = json.loads(out.read_text())
    assert data["cp"] == 2
    return data["cases"]


def result(cases: dict, name: str) -> dict:
    got = cases[name]
    if "crashed" in got:
        pytest.fail(f"case {name} crashed:\n{got['crashed']}")
    return got


def test_an_odd_length_is_padded_at_the_end_and_exact(cases) -> None:
    got = result(cases, "readme_loop_odd_length")
    assert got["local_len"] == 32  # 63 tokens padded to 64: each of the 2 ranks holds 32
    assert got["unsharded_shape"][1] == 63  # rt.unshard drops the padding
    assert got["restored"] == [2, 63] and got["restored_same"]  # a restored buffer is the caller's again
    assert got["logits"] <= TOLERANCE and got["grads"] <= TOLERANCE


def test_the_models_own_loss_on_an_odd_length(cases) -> None:
    got = result(cases, "model_loss_odd_length")
    assert got["loss"] <= TOLERANCE and got["grads"] <= TOLERANCE


def test_a_right_padded_batch_equals_one_process_with_its_mask(cases) -> None:
    got = result(cases, "right_padding")
    assert got["loss"] <= TOLERANCE and got["grads"] <= TOLERANCE and got["logits"] <= TOLERANCE


def test_packed_documents_on_an_odd_length(cases) -> None:
    got = result(cases, "packed_odd_length")
    assert got["logits"] <= TOLERANCE and got["grads"] <= TOLERANCE


def test_labels_that_would_count_the_padding_are_refused_or_padded_as_told(cases) -> None:
    got = result(cases, "pad_values_for_plain_labels")
    assert "rt.token_mean's loss counts the tokens appended at the end" in got["refused"]
    assert "pad_values" in got["refused"]
    assert got["grads"] <= TOLERANCE


REFUSALS = {
    "left_padding": ["left padding or holes", "pad on the right"],
    "labels_on_padding": ["labels count padding tokens", "set the labels of padding tokens to -100"],
    "not_causal_padded": ["not causal", "the sequence of 31 tokens was padded to 32", "multiple of 4"],
    "pad_values_length": ["1 buffers but 2 pad_values"],
    "shard_uneven": ["sequence length 7 is not divisible by 2 * cp_size (4)"],
}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_padding_cannot_make_exact_is_refused(cases, name: str) -> None:
    message = result(cases, "refusals")[name]
    assert message is not None, f"{name} was not refused"
    for fragment in REFUSALS[name]:
        assert fragment in message, message
