"""End to end: scripts/train_llama.py under `cpctl launch` gives the losses of one plain process.

The reference is `python scripts/train_llama.py` (a world of one, no CP). Every layout below
must reproduce its per-step losses within 1e-4. A second reference with --lr 0 shows the
comparison is about training: from step 1 on its losses are far from the trained ones, so a
layout whose gradients or optimizer steps were wrong could not match. Each launch costs
seconds (an `import torch` per process), so the runs are few and shared by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish, launch_once, plain_losses

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


def plain_run(tmp: Path, *extra: str) -> dict:
    return plain_losses(SCRIPT, *TRAIN_ARGS, *extra, tmp_path=tmp)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return plain_run(tmp_path_factory.mktemp("train_reference"))


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return plain_run(tmp_path_factory.mktemp("train_lr0"), "--lr", "0")


SCRIPT_ARGS = {"cp2-chunked-loss": ("--chunked-loss",)}  # the example's own options, per layout


def launch_layout(tmp: Path, layout: str) -> dict:
    """The losses file of one `cpctl launch` of the example in `layout`."""
    out = tmp / "losses.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", *LAYOUTS[layout], str(SCRIPT), *TRAIN_ARGS,
                                        *SCRIPT_ARGS.get(layout, ()), "--losses-out", str(out), tmp_path=tmp))
    if code != 0 or not out.exists():
        pytest.fail(f"cpctl launch {layout} exited {code}:\n{stdout}\n{stderr}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory):
    """layout name -> the run's losses file; each layout is launched once, on first use."""
    return launch_once(tmp_path_factory, "train", launch_layout)


def test_the_reference_trains(reference: dict, untrained: dict) -> None:
    losses, frozen = reference["losses"], untrained["losses"]
    assert (reference["world"], reference["cp"], reference["dp"]) == (1, 1, 1)
    assert len(losses) == len(frozen) == 4
    assert len(set(losses)) == len(losses)  # the loss changes from step to step
    assert losses[0] == frozen[0]  # same weights, same first batch
    # after the first update the losses move far more than the tolerance used below
    assert all(abs(trained - still) > 100 * TOLERANCE for trained, still in zip(losses[1:], frozen[1:]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_launched_losses_equal_the_single_process_losses(launched, reference: dict, layout: str) -> None:
    run = launched(layout)
    assert (run["world"], run["cp"], run["dp"]) == EXPECTED_SIZES[layout]
    assert len(run["losses"]) == len(reference["losses"])
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"])):
        assert abs(got - want) <= TOLERANCE, f"step {step}: {got} vs {want} (all: {run['losses']})"
