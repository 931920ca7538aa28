"""End to end: scripts/train_llama.py under `cpctl launch` gives the losses of one plain process.

The reference is scripts/train_llama.py in one process (a world of one, no CP). Every layout below
must reproduce its per-step losses within 1e-4: cp 2 launched by `cpctl launch`, the others (full
tier) with the profile the same flags give, in the session's pools of processes (tests/pool.py).
A second reference with --lr 0 shows the comparison is about training: from step 1 on its losses
are far from the trained ones, so a layout whose gradients or optimizer steps were wrong could not
match. Each run is shared by the tests that read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish, launch_once, tiered
from pool import Pools

SCRIPT = REPO / "scripts" / "train_llama.py"
TRAIN_ARGS = ("--preset", "tiny", "--steps", "4", "--seq-len", "64", "--global-batch", "2")
TOLERANCE = 1e-4

LAYOUTS = {
    "cp2": ("--nproc-per-node", "2", "--cp-size", "2"),
    "cp4": ("--nproc-per-node", "4", "--cp-size", "4"),
    "dp2-cp2": ("--nproc-per-node", "4", "--cp-size", "2", "--dp-shard-size", "2"),
    "cp2-alltoall": ("--nproc-per-node", "2", "--cp-size", "2", "--cp-comm-strategy", "alltoall"),
    # activation checkpointing: the recompute in backward must attend across the CP group too
    "cp2-checkpointing": ("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true"),
    # the MLP in tiles of 16 tokens and the norms in tiles of 24 (a shard holds 64), inside checkpointed blocks
    "cp2-tiled": ("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true",
                  "--tiled-mlp-tokens", "16", "--tiled-norm-tokens", "24"),
    # the selective level: attention's outputs kept, its recompute replayed (CP, and plain SDPA at cp 1)
    "cp2-selective": ("--nproc-per-node", "2", "--cp-size", "2", "--cp-comm-strategy", "alltoall",
                      "--activation-checkpointing", "true", "--checkpoint-level", "selective"),
    "dp2-selective": ("--nproc-per-node", "2", "--cp-size", "1", "--activation-checkpointing", "true",
                      "--checkpoint-level", "selective", "--tiled-mlp-tokens", "16"),
    # the mixed level: the last block selective, the first fully recomputed; and as many as fit (both)
    "cp2-mixed": ("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true",
                  "--checkpoint-level", "mixed", "--selective-blocks", "1"),
    "cp2-mixed-fit": ("--nproc-per-node", "2", "--cp-size", "2", "--activation-checkpointing", "true",
                      "--checkpoint-level", "mixed"),
    # the loss from the hidden states and the head, 24 tokens at a time (chunks cut through shards)
    "cp2-chunked-loss": ("--nproc-per-node", "2", "--cp-size", "2", "--loss-chunk-tokens", "24"),
    "tp2-cp2": ("--nproc-per-node", "4", "--cp-size", "2", "--tp-size", "2", "--dp-shard-size", "1"),
    "hsdp2-cp2": ("--nproc-per-node", "4", "--cp-size", "2", "--dp-replicate-size", "2", "--dp-shard-size", "1"),
}
EXPECTED_SIZES = {"cp2": (2, 2, 1), "cp4": (4, 4, 1), "dp2-cp2": (4, 2, 2), "cp2-alltoall": (2, 2, 1),
                  "cp2-checkpointing": (2, 2, 1), "cp2-tiled": (2, 2, 1), "cp2-chunked-loss": (2, 2, 1),
                  "cp2-selective": (2, 2, 1), "dp2-selective": (2, 1, 2), "cp2-mixed": (2, 2, 1),
                  "cp2-mixed-fit": (2, 2, 1), "tp2-cp2": (4, 2, 1), "hsdp2-cp2": (4, 2, 2)}


def plain_run(pools: Pools, tmp: Path, *extra: str) -> dict:
    """The losses file of the example in one process (the session's pool of one, tests/pool.py)."""
    out = tmp / "losses.json"
    pools[1].run(SCRIPT, *TRAIN_ARGS, *extra, "--losses-out", str(out), cwd=tmp)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    return plain_run(pools, tmp_path_factory.mktemp("train_reference"))


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory, pools) -> dict:
    return plain_run(pools, tmp_path_factory.mktemp("train_lr0"), "--lr", "0")


SCRIPT_ARGS = {"cp2-chunked-loss": ("--chunked-loss",)}  # the example's own options, per layout


LAUNCHED = "cp2"  # through `cpctl launch` itself; the other layouts in the session's pools (tests/pool.py)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, pools):
    """layout name -> the run's losses file; each layout is run once, on first use."""

    def run(tmp: Path, layout: str) -> dict:
        out = tmp / "losses.json"
        script_args = (*TRAIN_ARGS, *SCRIPT_ARGS.get(layout, ()), "--losses-out", str(out))
        if layout != LAUNCHED:
            pools.run(SCRIPT, *script_args, flags=LAYOUTS[layout], cwd=tmp)
            return json.loads(out.read_text())
        code, stdout, stderr = finish(cpctl("--device", "cpu", *LAYOUTS[layout], str(SCRIPT), *script_args,
                                            tmp_path=tmp))
        if code != 0 or not out.exists():
            pytest.fail(f"cpctl launch {layout} exited {code}:\n{stdout}\n{stderr}")
        return json.loads(out.read_text())

    return launch_once(tmp_path_factory, "train", run)


def test_the_reference_trains(reference: dict, untrained: dict) -> None:
    losses, frozen = reference["losses"], untrained["losses"]
    assert (reference["world"], reference["cp"], reference["dp"]) == (1, 1, 1)
    assert len(losses) == len(frozen) == 4
    assert len(set(losses)) == len(losses)  # the loss changes from step to step
    assert losses[0] == frozen[0]  # same weights, same first batch
    # after the first update the losses move far more than the tolerance used below
    assert all(abs(trained - still) > 100 * TOLERANCE for trained, still in zip(losses[1:], frozen[1:]))


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick={LAUNCHED}))
def test_launched_losses_equal_the_single_process_losses(launched, reference: dict, layout: str) -> None:
    run = launched(layout)
    assert (run["world"], run["cp"], run["dp"]) == EXPECTED_SIZES[layout]
    assert len(run["losses"]) == len(reference["losses"])
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"])):
        assert abs(got - want) <= TOLERANCE, f"step {step}: {got} vs {want} (all: {run['losses']})"
