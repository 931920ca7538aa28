"""The Ulysses x ring split: planner/layouts.py's choice, `parallelism.sp_size: auto` in the
profile (resolved from the profile's `model`), and what `--dry-run`, `cpctl plan` and the
wizard say about it. Plain Python, no torch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from test_profile import resolve_apart
from test_wizard import CLEAR, ENTER, drive, resolved, typed
from typer.testing import CliRunner

from cpctl import config as P
from cpctl.errors import CpctlError
from cpctl.launch.cli import app
from cpctl.planner import PRESETS
from cpctl.planner.layouts import choose_layout

LLAMA_8B = PRESETS["llama-3.1-8b"]  # 32 q heads, 8 K/V heads


def heads(q: int, kv: int):
    return dataclasses.replace(LLAMA_8B, n_heads=q, n_kv_heads=kv)


# ----------------------------------------------------------------------------- the choice


@pytest.mark.parametrize(("model", "ranks", "per_node", "tp", "split", "fragments"), [
    # 8 GPUs a node, 32/8 heads: Ulysses over the node, no ring
    (LLAMA_8B, 8, 8, 1, (8, 1), ["Ulysses sp 8 within a node", "4 of the 32 heads", "no ring"]),
    (LLAMA_8B, 4, 8, 1, (4, 1), ["8 of the 32 heads", "no ring"]),
    # more ranks than a node: Ulysses inside each, the ring across nodes
    (LLAMA_8B, 16, 8, 1, (8, 2), ["the ring over cp 2 across nodes"]),
    (LLAMA_8B, 32, 8, 1, (8, 4), ["the ring over cp 4 across nodes"]),
    # heads that 8 does not divide: the widest sp that does, the ring inside the node for the rest
    (heads(12, 2), 8, 8, 1, (4, 2), ["3 of the 12 heads", "its 2 K/V heads are repeated 2x",
                                     "the ring over cp 2 within the node", "sp 8 would not divide the 12 heads"]),
    (heads(6, 1), 16, 8, 1, (2, 8), ["its 1 K/V head is repeated 2x", "across nodes", "sp 4 would not divide"]),
    # no sp > 1 divides the heads: the ring alone
    (heads(25, 5), 8, 8, 1, (1, 8), ["the ring alone", "25 attention heads"]),
    # tp 2 takes half of each node and half of the heads
    (LLAMA_8B, 8, 8, 2, (4, 2), ["4 of the 16 heads of its tp rank", "across nodes"]),
    # a machine of 4: Ulysses over 4, the ring across
    (LLAMA_8B, 8, 4, 1, (4, 2), ["the ring over cp 2 across nodes"]),
    (LLAMA_8B, 1, 8, 1, (1, 1), ["one rank per sequence", "nothing to split"]),
])
def test_the_split_for_typical_shapes(model, ranks, per_node, tp, split, fragments) -> None:
    layout = choose_layout(model, seq_ranks=ranks, ranks_per_node=per_node, tp=tp)
    assert (layout.sp, layout.cp) == split
    assert layout.sp * layout.cp == ranks
    for fragment in fragments:
        assert fragment in layout.reason, layout.reason


@pytest.mark.parametrize("ranks", [1, 2, 4, 8, 16, 24, 32, 64])
@pytest.mark.parametrize("q_heads", [1, 2, 3, 4, 6, 12, 24, 25, 32, 40, 64])
def test_every_split_is_one_the_engine_runs_inside_a_node(ranks: int, q_heads: int) -> None:
    """sp divides the heads (prepare_model refuses otherwise) and its block of ranks fits a node."""
    layout = choose_layout(heads(q_heads, 1), seq_ranks=ranks, ranks_per_node=8)
    assert layout.sp * layout.cp == ranks and q_heads % layout.sp == 0 and 8 % layout.sp == 0


# ----------------------------------------------------------------------------- sp_size: auto


def test_sp_size_auto_splits_cp_size_from_the_model(tmp_path: Path) -> None:
    got = resolve_apart(tmp_path, machine=P.Machine(cuda_devices=8), flags={
        "parallelism.sp_size": "auto", "parallelism.cp_size": "16", "model": "llama-3.1-8b",
        "launch.nnodes": "2", "launch.rdzv_endpoint": "node0:29500"})
    par = got.profile.parallelism
    assert (par.sp_size, par.cp_size, par.dp_shard_size, got.profile.world_size) == (8, 2, 1, 16)
    assert got.sources["parallelism.sp_size"].startswith("auto (llama-3.1-8b: Ulysses sp 8 within a node")
    assert got.auto_reason("parallelism.sp_size").startswith("llama-3.1-8b: Ulysses sp 8 within a node")  # as data
    assert got.auto_reason("parallelism.cp_size") is None  # given, not auto's choice
    assert got.sources["parallelism.cp_size"] == ("flag --cp-size: 16 ranks per sequence, split by sp_size auto "
                                                 "into sp 8 x cp 2")
    # the workers get numbers, never auto
    assert "auto" not in json.dumps(got.profile.to_dict())


def test_sp_size_auto_reads_a_hugging_face_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative model path is read from where cpctl runs
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 896, "num_hidden_layers": 2,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}))
    (tmp_path / "cpctl.yaml").write_text("model: qwen\nparallelism: {cp_size: 4, sp_size: auto}\n")
    got = resolve_apart(tmp_path, machine=P.Machine(cuda_devices=4), flags={"launch.device": "cuda"})
    assert (got.profile.parallelism.sp_size, got.profile.parallelism.cp_size) == (2, 2)
    assert "sp 4 would not divide the 14 heads" in got.sources["parallelism.sp_size"]
    assert got.sources["parallelism.cp_size"].startswith("./cpctl.yaml: 4 ranks per sequence")


def test_sp_size_auto_resolves_inside_a_plain_torchrun_worker(tmp_path: Path) -> None:
    environ = {"CPCTL_SP_SIZE": "auto", "CPCTL_CP_SIZE": "4", "CPCTL_MODEL": "tiny", "CPCTL_DEVICE": "cpu",
               "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    par = P.for_worker({}, environ=environ, cuda_devices=0, cwd=tmp_path).profile.parallelism
    assert (par.sp_size, par.cp_size) == (4, 1)  # tiny: 4 heads
    alone = P.for_worker({}, environ={**environ, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, cuda_devices=0,
                         cwd=tmp_path).profile.parallelism
    assert (alone.sp_size, alone.cp_size) == (1, 1)  # plain python: nothing to split, sp included


@pytest.mark.parametrize(("flags", "fragment"), [
    ({"parallelism.sp_size": "auto", "parallelism.cp_size": "2"},
     ("parallelism.sp_size: auto splits each sequence's ranks into Ulysses x ring from the model's attention "
      "heads; name the model (--model PRESET or a config.json")),
    ({"parallelism.sp_size": "auto", "parallelism.cp_size": "2", "model": "llama-3.1-8"},
     "--model llama-3.1-8: no such preset or file; did you mean llama-3.1-8b?"),
    ({"parallelism.sp_size": "auto", "parallelism.cp_size": "2", "model": "missing/config.json"}, "no such file"),
    ({"parallelism.sp_size": "auto", "parallelism.cp_size": "3", "model": "1b"}, "does not divide world size 2"),
])
def test_sp_size_auto_without_what_it_needs_is_one_line(tmp_path: Path, flags, fragment) -> None:
    with pytest.raises(CpctlError) as caught:
        resolve_apart(tmp_path, flags={"launch.device": "cpu", **flags})
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- what the commands show


@pytest.fixture
def cli(isolated: Path):
    (isolated / "train.py").write_text("import cpctl\n\nrt = cpctl.init()\n")
    return lambda *args: CliRunner().invoke(app, list(args))


def test_the_dry_run_shows_the_split_and_why(cli) -> None:
    result = cli("launch", "--dry-run", "--device", "cuda", "--nproc-per-node", "8", "--nnodes", "2",
                 "--rdzv-endpoint", "node0:29500", "--cp-size", "16", "--sp-size", "auto", "--model", "llama-3.1-8b",
                 "train.py")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert ("sp_size auto: sp 8 x cp 2, for llama-3.1-8b: Ulysses sp 8 within a node (each rank attends with 4 of "
            "the 32 heads), the ring over cp 2 across nodes") in text
    assert "Ulysses: sp 8 on consecutive ranks, inside one node, the allgather ring over cp 2 outside it" in text
    assert '"cp_size":2,"sp_size":8' in result.stdout.replace(" ", "")  # what every worker is handed


def test_the_dry_run_of_a_fixed_split_says_nothing_of_auto(cli) -> None:
    result = cli("launch", "--dry-run", "--device", "cpu", "--nproc-per-node", "4", "--cp-size", "2", "--sp-size", "2",
                 "--model", "tiny", "train.py")
    assert result.exit_code == 0, result.output
    assert "sp_size auto" not in result.stdout


def test_plan_of_machines_given_as_nnodes_needs_no_rendezvous(cli, isolated: Path) -> None:
    """A plan is arithmetic: the endpoint a launch of several machines needs is not asked for."""
    result = cli("plan", "--model", "1b", "--seq-len", "64k", "--gpus", "12", "--nnodes", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["profile"]["target"].startswith("2 nodes with 6 GPUs each")


def test_plan_prints_the_split_sp_size_auto_chose(cli, isolated: Path) -> None:
    (isolated / "long.yaml").write_text("model: llama-3.1-8b\nparallelism: {sp_size: auto}\n")
    result = cli("plan", "--config", "long.yaml", "--seq-len", "1M", "--gpus", "16", "--chunked-loss", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["model"]["name"] == "llama-3.1-8b"  # the profile's model: no --model needed
    assert (plan["estimate"]["setup"]["sp"], plan["estimate"]["setup"]["cp"]) == (8, 2)
    assert plan["profile"]["split_by_sp_size_auto"].endswith("the ring over cp 2 across nodes")
    assert "2 nodes of 8" in plan["profile"]["note"]
    assert plan["profile"]["target"].startswith("2 nodes with 8 GPUs each")  # the nodes --gpus 16 resolved to
    shown = cli("plan", "--config", "long.yaml", "--seq-len", "1M", "--gpus", "16", "--chunked-loss")
    assert "Split of the 16 sequence GPUs by sp_size auto: sp 8 x cp 2" in " ".join(shown.stdout.split())


def test_plan_suggests_a_split_it_would_choose(cli) -> None:
    result = cli("plan", "--model", "llama-3.1-8b", "--seq-len", "1M", "--gpus", "16", "--chunked-loss")
    assert result.exit_code == 0, result.output
    assert ("Split for 16 sequence GPUs: --sp-size 8 --cp-size 2, or --sp-size auto --cp-size 16"
            in " ".join(result.stdout.split()))


# ----------------------------------------------------------------------------- the wizard


def test_the_wizard_asks_for_the_model_when_sp_size_is_auto(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    keys = (ENTER + ENTER + ENTER + typed("4")     # the script's API read at launch, device auto, 1 machine, 4 processes
            + typed("4") + typed("auto")           # cp 4: the ranks per sequence; sp auto
            + typed("nope") + CLEAR + "tiny" + ENTER  # a model that is none is asked again
            + ENTER * 3                            # tp 1, dp_replicate 1, dp_shard 1
            + ENTER * 5)                           # strategy, load balance, precision, checkpointing, memory
    code, shown = drive(keys, output=out)
    assert code == 0, shown
    text = out.read_text()
    written = yaml.safe_load(text)
    assert written["model"] == "tiny" and written["parallelism"]["sp_size"] == "auto"
    assert "# sp_size auto: sp 4 x cp 1, for tiny: Ulysses sp 4 within a node" in text
    got = resolved(out)
    assert (got.parallelism.sp_size, got.parallelism.cp_size, got.world_size) == (4, 1, 4)
    assert "auto (here: 4)" in shown
