"""cpctl/topology.py: the layout facts both sides rely on, written once. The planner and the profile
read them from there; the workers' own code (runtime/step.py, attention/ulysses.py) must agree with
them until it reads them too, which these tests check against it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from typer.testing import CliRunner

from cpctl import planner, topology
from cpctl.errors import CpctlError
from cpctl.launch.cli import app
from cpctl.planner import PRESETS, Setup


@pytest.mark.parametrize(("cp", "sp", "balanced", "chunks"), [
    (1, 1, True, 1), (1, 4, True, 4), (2, 1, True, 4), (2, 1, False, 2), (4, 2, True, 16), (4, 2, False, 8),
    (3, 1, True, 6), (3, 1, False, 3),
])
def test_a_sequence_is_cut_into_two_chunks_per_cp_rank_only_when_balanced(cp, sp, balanced, chunks) -> None:
    assert topology.sequence_chunks(cp=cp, sp=sp, load_balance=balanced) == chunks
    assert Setup(cp=cp, sp=sp, load_balance=balanced).sequence_chunks == chunks


def test_the_planners_chunks_are_the_runtimes() -> None:
    pytest.importorskip("torch")
    from cpctl.runtime.step import SequenceSplit

    for cp, sp, balanced in itertools.product((1, 2, 3, 4), (1, 2, 4), (True, False)):
        split = SequenceSplit(cp_size=cp, cp_rank=0, sp_size=sp, sp_rank=0, load_balance=balanced)
        assert split.tokens_of(split.plain_ring()).num_chunks == Setup(cp=cp, sp=sp, load_balance=balanced).sequence_chunks


def test_the_plan_pads_a_length_to_the_layouts_chunks_as_the_runtime_does() -> None:
    """1000 tokens over cp 8: head-tail cuts them into 16 chunks, so the runtime pads them to 1008 (126 a
    GPU); without load balance 8 chunks of 125."""
    model = PRESETS["tiny"]
    balanced, plain = (planner.estimate(model, Setup(gpus=8, cp=8, load_balance=on), 1000) for on in (True, False))
    assert (balanced.local_tokens, plain.local_tokens) == (126, 125)


def test_the_plan_reads_cp_load_balance_from_the_profile(isolated) -> None:
    import json

    def local_tokens(*extra: str) -> int:
        result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--seq-len", "1000", "--gpus", "8", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["estimate"]["local_tokens"]

    assert (local_tokens(), local_tokens("--cp-load-balance", "false")) == (126, 125)


@pytest.mark.parametrize(("q_heads", "kv_heads", "sp", "copies"), [
    (32, 8, 1, 1), (32, 8, 4, 1), (32, 8, 16, 2), (32, 8, 32, 4), (24, 8, 16, "refused"), (14, 2, 4, "refused"),
    (14, 2, 7, 7), (4, 1, 2, 2), (12, 8, 2, "refused"),
])
def test_kv_heads_are_repeated_until_the_sp_ranks_can_split_them(q_heads: int, kv_heads: int, sp: int,
                                                                  copies: int | str) -> None:
    """The one rule the Ulysses engine and the planner both use: q heads must divide over sp (and be
    a multiple of the K/V heads); K/V heads are repeated up to their least common multiple with sp."""
    try:
        got = topology.kv_copies(q_heads=q_heads, kv_heads=kv_heads, sp=sp)
    except CpctlError:
        got = "refused"
    assert got == copies
    assert (topology.heads_split_problem(q_heads, sp=sp) is None) == (q_heads % sp == 0)


def test_the_planner_refuses_a_split_the_heads_do_not_allow(isolated) -> None:
    """Llama-3.2-3B has 24 heads: Ulysses over 16 ranks cannot split them, as the workers would say."""
    with pytest.raises(CpctlError, match="sp_size 16 splits attention heads, but it has 24 attention heads"):
        planner.estimate(PRESETS["llama-3.2-3b"], dataclasses.replace(Setup(), gpus=16, cp=1, sp=16), 64 * 1024)
    layout = planner.layouts.choose_layout(PRESETS["llama-3.2-3b"], seq_ranks=16, ranks_per_node=16)
    assert (layout.sp, layout.cp) == (8, 2)  # the widest sp the heads allow


def test_a_node_is_8_gpus_wherever_none_is_known() -> None:
    from cpctl.config.rules import Machine, target_machine

    assert Setup().gpus_per_node == topology.GPUS_PER_NODE == 8
    machine, why = target_machine({"launch.device": "cuda"}, detected=Machine(cuda_devices=0))
    assert machine.cuda_devices == topology.GPUS_PER_NODE and "a node of 8 assumed" in why
