"""tests/pool.py, the session's long-lived worker processes: a job runs in every rank with the
profile of its flags, its own runtime each time, and a failure is the test's, naming the rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pool import FAILED_PEERS_GRACE_S

REPORT_PROFILE = """\
import json, sys
from pathlib import Path
import cpctl
rt = cpctl.init()
profile = {"world": rt.world_size, "cp": rt.cp_size, "dp": rt.dp_size,
           "strategy": rt.config.parallelism.cp_comm_strategy}
Path(sys.argv[1], f"rank{rt.rank}.json").write_text(json.dumps(profile))
print(f"rank {rt.rank} done")
"""

FAIL_ON_RANK_1 = """\
import torch.distributed as dist
if dist.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
"""

FAIL_ON_RANK_1_WHILE_RANK_0_WAITS = """\
import torch.distributed as dist
if dist.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
dist.barrier()  # never reached by rank 1
"""


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(text)
    return path


def profiles(pool, tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "-".join(flags)
    out.mkdir()
    printed = pool.run(script(tmp_path, REPORT_PROFILE), str(out), flags=flags, cwd=tmp_path)
    assert printed == [f"rank {rank} done\n" for rank in range(pool.world)]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(pool.world)]


def test_each_job_runs_with_the_profile_of_its_flags(pools, tmp_path: Path) -> None:
    assert profiles(pools[2], tmp_path, "--cp-size", "2", "--cp-comm-strategy", "alltoall") == [
        {"world": 2, "cp": 2, "dp": 1, "strategy": "alltoall"}] * 2
    assert profiles(pools[2], tmp_path, "--cp-size", "1") == [
        {"world": 2, "cp": 1, "dp": 2, "strategy": "allgather"}] * 2


def test_a_failing_job_fails_its_test_naming_the_rank_and_the_pool_goes_on(pools, tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        pools[2].run(script(tmp_path, FAIL_ON_RANK_1), cwd=tmp_path)
    assert "rank 1: Traceback" in str(failed.value) and "ValueError: rank 1 fails on purpose" in str(failed.value)
    assert "rank 0:" not in str(failed.value)
    pid = pools[2].proc.pid
    assert profiles(pools[2], tmp_path, "--cp-size", "2")[0]["cp"] == 2
    assert pools[2].proc.pid == pid  # every rank ended the failed job: the same processes took the next


@pytest.mark.full  # it costs a fresh pool
def test_a_rank_left_waiting_by_a_failed_peer_ends_the_pool_and_the_next_job_gets_a_fresh_one(
        pools, tmp_path: Path) -> None:
    outcome = pools[2].attempt(script(tmp_path, FAIL_ON_RANK_1_WHILE_RANK_0_WAITS), cwd=tmp_path)
    assert not outcome.ok
    assert "ValueError: rank 1 fails on purpose" in outcome.failures[1]
    assert outcome.failures[0] == f"no result {FAILED_PEERS_GRACE_S}s after another rank failed"
    assert pools[2].proc is None
    assert profiles(pools[2], tmp_path, "--cp-size", "2")[1]["cp"] == 2


ACCELERATE_JOB = """\
import json, os, sys
import torch.distributed as dist
from accelerate import Accelerator
from cpctl.integrations.patches import PATCHES
accelerator = Accelerator()
seen = {"fsdp": os.environ.get("ACCELERATE_USE_FSDP"), "cp": accelerator.parallelism_config.cp_size,
        "patched": bool(PATCHES.applied())}
accelerator.end_training()  # destroys the default process group, in a real launch
if accelerator.is_main_process:
    json.dump(seen, open(sys.argv[1], "w"))
"""

AFTER_IT = """\
import json, os, sys
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from cpctl.integrations.patches import PATCHES
left = {"patches": PATCHES.applied(), "accelerator_state": bool(AcceleratorState._shared_state),
        "partial_state": bool(PartialState._shared_state), "fsdp": os.environ.get("ACCELERATE_USE_FSDP"),
        "group": dist.is_initialized() and dist.get_world_size()}
dist.barrier()
if dist.get_rank() == 0:
    json.dump(left, open(sys.argv[1], "w"))
"""


def test_an_accelerate_job_runs_as_launched_and_leaves_nothing_to_the_next(pools, tmp_path: Path) -> None:
    """A `--script-api accelerate` job gets accelerate's variables and cpctl's shim, as a launch
    would; the job after it finds what a fresh process has: no patch, no accelerate state, no
    accelerate variable, the pool's process group (end_training did not destroy it)."""
    pytest.importorskip("accelerate")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pools[2].run(script(tmp_path / "a", ACCELERATE_JOB), str(tmp_path / "seen.json"),
                 flags=("--cp-size", "2", "--script-api", "accelerate"), cwd=tmp_path)
    assert json.loads((tmp_path / "seen.json").read_text()) == {"fsdp": "true", "cp": 2, "patched": True}
    pools[2].run(script(tmp_path / "b", AFTER_IT), str(tmp_path / "left.json"), cwd=tmp_path)
    assert json.loads((tmp_path / "left.json").read_text()) == {
        "patches": [], "accelerator_state": False, "partial_state": False, "fsdp": None, "group": 2}
