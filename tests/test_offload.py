"""Offloaded activations in their host arena, and the mixed checkpointing level, on CPU.

tests/workers/offload_cases.py trains the example Llama (4 layers) for a few steps in one process
(the session's one-process pool, tests/pool.py) at each checkpointing setup, beside the same model trained without checkpointing. On
CPU the arena copies tensors into its buffers and back exactly as on a GPU (only the CUDA
registration is left out), so these check what a GPU run relies on: the step is exact, the
buffers are made once and reused, the host memory is what `cpctl plan` says, the mixed level
keeps attention's tensors in as many blocks as asked (or as `cpctl plan` chose), and a forward
that raises inside the model leaves no saved-tensor hook behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, launch_once

WORKER = REPO / "tests" / "workers" / "offload_cases.py"
BLOCKS = 4
CASES = {  # name: cpctl.init overrides
    "full": ["checkpoint_level=full"],
    "mixed-2": ["checkpoint_level=mixed", "selective_blocks=2"],
    "mixed-fit": ["checkpoint_level=mixed"],
}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory, pools):
    """name -> the worker's result; each case run once, on first use, in the session's one-process pool
    (tests/pool.py)."""

    def run(tmp: Path, name: str) -> dict:
        out = tmp / "result.json"
        pools[1].run(WORKER, str(out), "--offload", *CASES[name], cwd=tmp)
        return json.loads(out.read_text())

    return launch_once(tmp_path_factory, "offload", run)


@pytest.mark.parametrize("name", list(CASES))
def test_an_offloaded_step_is_exact(case, name: str) -> None:
    result = case(name)
    assert result["losses"] == pytest.approx(result["reference"], abs=1e-6)
    assert result["param_error"] <= 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_the_arena_is_made_once_and_is_what_the_plan_says(case, name: str) -> None:
    steps = case(name)["arena"]
    assert steps[0]["allocations"] > 0
    # later steps take the first step's buffers again: nothing new is allocated
    assert all(step["allocations"] == steps[0]["allocations"] for step in steps)
    assert all(step["peak_bytes"] == steps[0]["peak_bytes"] == step["allocated_bytes"] for step in steps)
    assert all(step["in_use_bytes"] == 0 for step in steps)  # every buffer is back once backward is done
    # exact sizes: the host memory is cpctl plan's to the byte (the planner counts every saved tensor)
    assert steps[0]["peak_bytes"] == case(name)["plan_host_bytes"]


def test_the_mixed_level_applies_the_count_asked_for_or_the_plans(case) -> None:
    full, two, fit = case("full"), case("mixed-2"), case("mixed-fit")
    assert (full["selective_blocks"], two["selective_blocks"]) == (0, 2)
    assert fit["selective_blocks"] == fit["plan_selective_blocks"] == BLOCKS  # a tiny model fits whole
    # each selective block keeps attention's tensors in the arena: the same amount per block
    per_block = (two["arena"][0]["peak_bytes"] - full["arena"][0]["peak_bytes"]) / 2
    assert per_block > 0
    assert fit["arena"][0]["peak_bytes"] == full["arena"][0]["peak_bytes"] + BLOCKS * per_block


@pytest.mark.parametrize("name", list(CASES))
def test_a_forward_that_raises_leaves_nothing_behind(case, name: str) -> None:
    result = case(name)
    assert result["raised"]
    assert result["saved_outside_is_the_tensor"]  # no offload hook left pushed after the failed forward
    assert result["losses"][-1] == pytest.approx(result["reference"][-1], abs=1e-6)  # and the next step is exact


# ----------------------------------------------------------------------------- the arena itself, in this process


def test_the_arena_gives_back_every_tensor_exactly_and_reuses_its_buffers() -> None:
    torch = pytest.importorskip("torch")
    from cpctl.runtime.pinned import HostArena

    arena = HostArena(torch.device("cpu"))
    tensors = [torch.randn(6, 5).t(), torch.arange(7), torch.randn(3, 4).to(torch.bfloat16), torch.randn(2, 3, 4)[:, 1]]
    for _ in range(3):  # three "steps": the same sizes each time
        packed = [arena.pack(t) for t in tensors]
        assert arena.in_use_bytes == arena.allocated_bytes == sum(t.numel() * t.element_size() for t in tensors)
        for tensor, saved in zip(tensors, packed):
            back = arena.unpack(saved)
            assert back.dtype == tensor.dtype and torch.equal(back, tensor)
        del packed, saved  # what autograd does after backward: the buffers go back
        assert arena.in_use_bytes == 0
    assert arena.allocations == len(tensors)  # made in the first step, taken again in the others


def test_a_tensor_saved_twice_is_copied_once_and_parameters_never() -> None:
    torch = pytest.importorskip("torch")
    from cpctl.runtime.pinned import HostArena

    arena = HostArena(torch.device("cpu"))
    x = torch.randn(4, 8)
    before = x.clone()
    first, second = arena.pack(x), arena.pack(x.detach())  # the same memory, unchanged: one buffer
    assert arena.allocated_bytes == x.numel() * 4
    x.add_(1)  # changed in place: a later save is a new copy, the earlier ones keep what they saved
    third = arena.pack(x)
    assert arena.allocated_bytes == 2 * x.numel() * 4
    assert torch.equal(arena.unpack(first), before) and torch.equal(arena.unpack(second), before)
    assert torch.equal(arena.unpack(third), x)
    weight = torch.nn.Parameter(torch.randn(3, 8))
    view = weight.t()  # a Linear saves its weight so
    assert arena.pack(weight) is weight and arena.pack(view) is view
    assert arena.allocated_bytes == 2 * x.numel() * 4  # neither the parameter nor its transposed view was copied
    del first, second, third


def test_a_buffer_the_machine_cannot_hold_is_one_error_not_the_oom_killer() -> None:
    torch = pytest.importorskip("torch")
    from cpctl.errors import CpctlError
    from cpctl.runtime.pinned import HostArena, available_host_bytes

    if available_host_bytes() is None:
        pytest.skip("no /proc/meminfo here")
    arena = HostArena(torch.device("meta"))  # a tensor with no memory behind it stands for a huge activation
    with pytest.raises(CpctlError, match=r"memory.offload_activations: the step needs \d+\.\d\d GiB more host memory"):
        arena.pack(torch.empty(2**50, dtype=torch.uint8, device="meta"))
    assert arena.allocated_bytes == 0
