"""The runtime API (docs/runtime.md) in real processes.

One run of tests/workers/runtime_cases.py at cp 2 in the session's pool of 2 gloo processes
(tests/pool.py: the profile of `cpctl launch --cp-size 2`) measures everything (a few seconds); one
run of the same worker in the pool of 1 checks the world of one; init overrides run under the
launcher. The worker only records numbers and messages; every assertion is here.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish

WORKER = REPO / "tests" / "workers" / "runtime_cases.py"
TOLERANCE = 1e-5  # the engine's fp32 bar: CP equals single-process SDPA within 1e-5
CP = 2


@pytest.fixture(scope="module")
def cp_ranks(tmp_path_factory: pytest.TempPathFactory, pools) -> list[dict]:
    tmp = tmp_path_factory.mktemp("runtime_cp")
    out = tmp / "results.json"
    pools[2].run(WORKER, str(out), flags=("--cp-size", str(CP)), cwd=tmp)
    data = json.loads(out.read_text())
    assert data["world"] == 2 and len(data["ranks"]) == 2
    return data["ranks"]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    tmp = tmp_path_factory.mktemp("runtime_single")
    out = tmp / "results.json"
    pools[1].run(WORKER, str(out), cwd=tmp)
    data = json.loads(out.read_text())
    assert data["world"] == 1 and len(data["ranks"]) == 1
    return data["ranks"][0]


def case(ranks: list[dict], name: str) -> list[dict]:
    """One case's results, per rank; a case that crashed in the worker fails with its traceback."""
    results = [rank_results[name] for rank_results in ranks]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "crashed" in result:
            pytest.fail(f"case {name} crashed on rank {rank}:\n{result['crashed']}")
    return results


def tokens_of(rank: int, seq: int) -> list[int]:
    """Positions a rank holds under head-tail load balance: chunks rank and 2*cp-1-rank."""
    chunk = seq // (2 * CP)
    return [t for c in (rank, 2 * CP - 1 - rank) for t in range(c * chunk, (c + 1) * chunk)]


# ------------------------------------------------------------------------------- attributes


def test_attributes_of_every_rank(cp_ranks) -> None:
    for rank, attrs in enumerate(case(cp_ranks, "attributes")):
        assert {k: attrs[k] for k in ("rank", "world_size", "cp_size", "cp_rank", "dp_size", "dp_rank", "is_main",
                                      "config_cp_size", "device")} == {
            "rank": rank, "world_size": 2, "cp_size": CP, "cp_rank": rank, "dp_size": 1, "dp_rank": 0,
            "is_main": rank == 0, "config_cp_size": CP, "device": "cpu"}
        assert attrs["mesh_dim_names"] == ["dp_replicate", "dp_shard", "cp", "sp", "tp"]
        assert attrs["mesh_shape"] == [1, 1, CP, 1, 1]
        assert attrs["flattened_sizes"] == {"dp": 1, "dp_shard_cp": CP, "dp_cp": CP}
        assert (attrs["strategy"], attrs["load_balance"]) == ("allgather", True)  # the profile's defaults


def test_init_is_idempotent(cp_ranks) -> None:
    assert all(attrs["init_again_is_same"] for attrs in case(cp_ranks, "attributes"))


# ------------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "seq_len_load_balance": ["sequence length 6", "2 * cp_size (4)", "pad the sequence to 8"],
    "seq_len_no_balance": ["sequence length 5", "cp_size (2)", "pad the sequence to 6"],
    "sdpa_full_mask": ["attn_mask", "attn_mask=None", "is_causal=True"],
    "sdpa_padding_mask": ["attn_mask", "attn_mask=None", "is_causal=True"],
    "sdpa_additive_window_mask": ["attn_mask", "attn_mask=None", "is_causal=True"],
    "sdpa_dropout": ["dropout_p=0.1", "set it to 0"],
    "no_restore_not_subset": ["no_restore_buffers", "subset of buffers"],
    "buffer_requires_grad": ["requires grad", "rt.shard()"],
    "buffers_vs_seq_dims": ["2 buffers but 1 buffer_seq_dims"],
    "gqa_without_enable_gqa": ["enable_gqa=True"],
    "duplicate_buffer": ["appears twice", "pass each buffer once"],
    "fsdp_version_1": ["fsdp.version: 1", "set fsdp.version: 2"],
    "mha_need_weights": ["need_weights=True", "need_weights=False"],
    "documents_wrong_length": ["documents has 6 positions", "first buffer 8 tokens", "full-length position ids"],
    "documents_not_tensor": ["documents must be a tensor", "position_ids_for_documents"],
}


def assert_clear_errors(cp_ranks, case_name: str, name: str, expected: dict) -> None:
    """On every rank, `name` of the worker's case raised a CpctlError holding every fragment."""
    for result in case(cp_ranks, case_name):
        error = result[name]
        assert error["type"] == "CpctlError", error
        for fragment in expected[name]:
            assert fragment in error["message"], error["message"]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_a_clear_error(cp_ranks, name: str) -> None:
    assert_clear_errors(cp_ranks, "bad_inputs", name, BAD_INPUTS)


MISUSE = {
    "labels_left_out": ["8 logits but 16 labels", "not sharded", "add them to maybe_context_parallel's buffers"],
    "token_mean_full_labels": ["full sequence length 8", "add it to buffers"],
    "labels_along_the_batch": ["token_mean's labels is among the buffers but was sharded along dim 0",
                               "give it 1 in buffer_seq_dims"],
    "different_data": ["got different inputs", "buffer 0", "rt.prepare_dataloader"],
    "different_lengths": ["got different inputs", "rt.prepare_dataloader"],
    "optimizer_before_prepare": ["SGD", "before rt.prepare_model", "Create the optimizer after"],
    "prepared_twice": ["the model is already sharded", "is a DTensor", "prepares a model once"],
}


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_is_a_clear_error_on_every_rank(cp_ranks, name: str) -> None:
    assert_clear_errors(cp_ranks, "misuse", name, MISUSE)


def test_an_optimizer_made_before_prepare_model_is_refused_in_one_process(single_rank) -> None:
    error = single_rank["misuse_single"]["optimizer_before_prepare"]
    assert error["type"] == "CpctlError" and "before rt.prepare_model" in error["message"], error


def test_a_model_prepared_twice_is_refused_in_one_process(single_rank) -> None:
    error = single_rank["misuse_single"]["prepared_twice"]
    assert error["type"] == "CpctlError" and "rt.prepare_model prepares a model once" in error["message"], error


@pytest.mark.parametrize(("name", "fragment"), [("quantized_float8", "is stored in float8_e4m3fn"),
                                              ("quantized_int8", "is a quantized module (torch.ao.nn.quantized.dynamic")])
def test_a_quantized_model_is_one_line_naming_what_is_quantized(single_rank, name: str, fragment: str) -> None:
    error = single_rank["misuse_single"][name]
    assert error["type"] == "CpctlError" and "a quantized model cannot be prepared by cpctl" in error["message"], error
    assert fragment in error["message"] and "load the base in bf16" in error["message"], error


def test_a_steps_state_ends_with_its_context(cp_ranks) -> None:
    """After a packed step (cost-placed chunks) rt.shard outside the context shards head-tail again;
    after a padded step whose body raised nothing of it is left; the step gathers its own results."""
    for rank, result in enumerate(case(cp_ranks, "step_state")):
        assert result["plain"] == [tokens_of(rank, 32)]
        assert result["inside"]["active"] and result["inside"]["shard"] != result["plain"]  # placed by cost
        after = result["after"]
        assert after["shard"] == result["plain"] and after["local_chunks"] == [rank, 2 * CP - 1 - rank]
        assert not after["active"] and after["ids_restored"]
        assert after["balance"] is not None and after["balance"] <= 1.25  # a report of the step, kept
        assert after["step_unshard"] == [[2 * t for t in range(32)]]
        assert after["rt_unshard"]["type"] == "CpctlError", after["rt_unshard"]
        assert "placed by cost" in after["rt_unshard"]["message"] and "step.unshard" in after["rt_unshard"]["message"]
        assert after["rt_shift_sharded"]["type"] == "CpctlError"
        assert after["rt_shift_sharded"]["message"].startswith("rt.shift_sharded after maybe_context_parallel")
        after_error = result["after_error"]
        assert after_error["raised"] == "the body failed"
        assert after_error["padding"] is None and not after_error["active"] and not after_error["appended"]
        assert after_error["shard"] == result["plain"] and after_error["ids_restored"]
        assert result["counted_tail"]["type"] == "CpctlError"
        assert "counts the tokens appended at the end (the sequence of 30 tokens was padded to 32" in \
            result["counted_tail"]["message"]
        assert result["plain_step_unshard"] == [[3 * t for t in range(32)]]


def test_an_error_inside_the_context_still_restores_the_buffers(cp_ranks) -> None:
    for result in case(cp_ranks, "bad_inputs"):
        assert result["ids_after_errors"] == [list(range(8))]


def test_a_rejected_call_leaves_no_buffer_half_sharded(cp_ranks) -> None:
    # buffers=[good (8 tokens), bad (6 tokens)]: the error must come before `good` is resized
    for result in case(cp_ranks, "bad_inputs"):
        assert result["mixed_lengths"]["type"] == "CpctlError"
        assert result["good_buffer_after_mixed_lengths"] == [list(range(8))]


def test_an_explicit_causal_mask_means_is_causal(cp_ranks) -> None:
    for result in case(cp_ranks, "causal_mask_accepted"):
        assert result["causal_vs_reference"] <= TOLERANCE
        assert result["bool_vs_causal"] <= TOLERANCE
        assert result["additive_vs_causal"] <= TOLERANCE


# ------------------------------------------------------------------------------- buffers


def test_buffers_are_sharded_inside_and_restored_on_exit(cp_ranks) -> None:
    full_ids = [list(range(8)), list(range(8, 16))]
    full_feats = [[list(range(24 * b + 8 * c, 24 * b + 8 * c + 8)) for c in range(3)] for b in range(2)]
    for rank, result in enumerate(case(cp_ranks, "buffers")):
        keep = tokens_of(rank, 8)
        inside = result["inside"]
        assert inside["ids"] == [[row[t] for t in keep] for row in full_ids]
        assert inside["feats"] == [[[float(row[t]) for t in keep] for row in batch] for batch in full_feats]
        assert inside["pos"] == [keep, keep]
        after = result["after"]
        assert after["ids"] == full_ids and result["ids_storage_back"]
        assert after["feats"] == [[[float(v) for v in row] for row in batch] for batch in full_feats]
        assert after["pos"] == [keep, keep]  # in no_restore_buffers: stays sharded


def test_unshard_of_shard_is_the_identity(cp_ranks) -> None:
    for rank, result in enumerate(case(cp_ranks, "shard_unshard")):
        assert result["roundtrip_dim1"] == 0.0 and result["roundtrip_last_dim"] == 0.0
        assert result["shard_tokens"] == [tokens_of(rank, 8), [8 + t for t in tokens_of(rank, 8)]]
        assert result["tokens_untouched"] and result["shard_is_new_tensor"]


# ------------------------------------------------------------------------------- attention

FUNCTIONAL = [f"{runtime}/causal={causal}/heads={heads}" for runtime, causal, heads in itertools.product(
    ("allgather_balanced", "alltoall_plain", "alltoall_balanced"), (True, False), ("4:4", "4:2", "4:1"))]


@pytest.mark.parametrize("label", FUNCTIONAL)
def test_functional_attention_equals_the_shards_of_full_sdpa(cp_ranks, label: str) -> None:
    for result in case(cp_ranks, "functional_attention"):
        assert sorted(result) == sorted(FUNCTIONAL)
        errors = result[label]
        assert sorted(errors) == ["dk", "dq", "dv", "out", "unshard(out)"]
        assert all(error <= TOLERANCE for error in errors.values()), errors


def test_a_model_inside_the_context_gives_the_full_sequence_result(cp_ranks) -> None:
    for result in case(cp_ranks, "model_in_context"):
        for runtime in ("rt", "alltoall_plain", "rt_again"):
            assert result[runtime]["local_len"] == 16 // CP
            assert result[runtime]["error"] <= TOLERANCE, (runtime, result[runtime])
        assert result["after_exit"] == 0.0  # outside the context SDPA is plain again


def test_two_cp_groups_in_one_process(cp_ranks) -> None:
    # WORLD and a new_group of the same ranks, different layouts and strategies, calls interleaved
    for result in case(cp_ranks, "two_groups"):
        assert len(result) == 3
        for label, errors in result.items():
            assert all(error <= TOLERANCE for error in errors.values()), (label, errors)


# ------------------------------------------------------------------------------- loss and grads


def test_token_mean_is_the_global_mean_on_every_rank(cp_ranks) -> None:
    results = case(cp_ranks, "token_mean")
    assert results[0]["local_tokens"] != results[1]["local_tokens"]  # else plain averaging would pass too
    assert results[0]["value"] == results[1]["value"]
    for result in results:
        assert result["value"] == pytest.approx(result["expected"], abs=1e-6)
    # FSDP averages gradients over dp x cp ranks: the average is d(global mean)/d(weight)
    averaged = sum(result["weight_grad"] for result in results) / results[0]["averaging"]
    assert averaged == pytest.approx(results[0]["expected"], abs=1e-6)


def test_prepared_model_gets_the_single_process_gradients(cp_ranks) -> None:
    for result in case(cp_ranks, "fsdp_gradients"):
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=TOLERANCE)
        assert len(result["grad_errors"]) == result["num_params"]
        assert result["largest_grad"] > 1e-2  # gradients are not trivially zero
        assert max(result["grad_errors"].values()) <= TOLERANCE, result["grad_errors"]


def test_cp_ranks_get_the_same_batches(cp_ranks) -> None:
    results = case(cp_ranks, "dataloader")
    batches = [result["batches"] for result in results]
    assert batches[0] == batches[1]
    assert sorted(i for batch in batches[0] for i in batch) == list(range(8))  # dp 1: the whole dataset
    # every pass is a new epoch: reshuffled, still the same on every rank of the CP group
    assert results[0]["second_epoch"] == results[1]["second_epoch"] != batches[0]


def test_multihead_attention_modules_attend_across_the_cp_group(cp_ranks) -> None:
    for result in case(cp_ranks, "multihead_attention"):
        assert set(result) == {"mha_train", "mha_eval", "encoder_layer_eval"}, result
        assert max(result.values()) <= TOLERANCE, result


# ------------------------------------------------------------------------------- world of one


def test_plain_python_is_a_world_of_one(single_rank) -> None:
    attrs = case([single_rank], "attributes")[0]
    assert {k: attrs[k] for k in ("rank", "world_size", "cp_size", "cp_rank", "dp_size", "dp_rank", "is_main",
                                  "config_cp_size")} == {
        "rank": 0, "world_size": 1, "cp_size": 1, "cp_rank": 0, "dp_size": 1, "dp_rank": 0, "is_main": True,
        "config_cp_size": 1}
    assert attrs["mesh_shape"] == [1, 1, 1, 1, 1] and attrs["init_again_is_same"]


def test_on_one_process_the_context_shards_nothing_and_attention_goes_through_the_engine(single_rank) -> None:
    result = case([single_rank], "single_process")[0]
    assert result["inside_ids"] == [list(range(7))] and result["same_storage"]  # 7 tokens: nothing to divide
    assert result["masked_sdpa_error"] == 0.0  # a mask over the whole sequence runs as it is
    assert result["engine_calls"] == 1 and result["causal_sdpa_error"] <= 1e-6  # causal SDPA: the engine's
    assert result["documents_error"] <= 1e-6  # documents= keeps attention inside each document, length 7
    assert "attn_mask" in (result["masked_with_documents"]["message"] or "")  # a mask cannot take documents
    assert result["shard_is_identity"] and result["unshard_is_identity"]
    assert result["attention_error"] <= 1e-6
    assert result["token_mean"] == 4.0  # 20 over the 5 labels that are not -100
    token_mean = case([single_rank], "token_mean")[0]
    assert token_mean["value"] == pytest.approx(token_mean["expected"], abs=1e-6)
    assert token_mean["weight_grad"] == pytest.approx(token_mean["expected"], abs=1e-6)


def test_init_overrides_resolve_auto_on_top_of_the_launched_profile(tmp_path: Path) -> None:
    """Through `cpctl launch` itself: workers get the profile resolved (CPCTL_RESOLVED_PROFILE), and
    `auto` must resolve again under the overrides; the pools hand over CPCTL_* keys only."""
    out = tmp_path / "init.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "1",
                                        str(REPO / "tests" / "workers" / "init_overrides.py"), str(out),
                                        tmp_path=tmp_path))
    assert code == 0, stdout + stderr
    result = json.loads(out.read_text())
    assert (result["cp"], result["dp_shard"], result["mixed_precision"]) == (2, 1, "no")
    assert result["same"] is True
    assert "cannot change" in result["changed"]
