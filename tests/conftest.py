"""Shared fixtures (`isolated` gives a test its own cwd and a clean cpctl environment) and the
test tiers: `pytest` runs the quick tier (every pure and in-process test, and one real launch
per capability); `pytest --full` adds the tests marked `full` (the rest of the launch matrices)."""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

import pytest
from launching import AMBIENT_PREFIXES


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cwd = an empty tmp dir; no CPCTL_*/SLURM_* variables, no user default profile, no GPUs
    visible (so `device: auto` means cpu on every machine), wide rich output. Returns the cwd."""
    for name in list(os.environ):
        if name.startswith(AMBIENT_PREFIXES):
            monkeypatch.delenv(name)
    config_home = tmp_path / "xdg-config"
    config_home.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps table cells at the terminal width
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture(scope="session")
def tiny_hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny local hub (model, tokenizer, texts) for unmodified ecosystem scripts: tests/workers/tiny_hub.py."""
    import subprocess

    from launching import REPO, TIMEOUT, launch_env

    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hub")
    subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "tiny_hub.py"), str(out)], check=True,
                   env=launch_env(out), capture_output=True, timeout=TIMEOUT)
    return out


# The full tier only: the rest of each launch matrix, beyond one case per capability (node-id
# patterns). The quick tier keeps, per capability, the case that exercises it most directly.
FULL_TIER_ONLY = (
    "tests/test_faults.py::test_the_launcher_names_the_root_cause_from_the_reports_workers_wrote",  # 2 workers failing
    "tests/test_engine.py::*[4*",                                   # world 4 (world 2 stays)
    "tests/test_training.py::test_launched_losses_equal_the_single_process_losses[[]c*-*",  # cp2 stays
    "tests/test_training.py::test_launched_losses_equal_the_single_process_losses[[]cp4]",
    "tests/test_training.py::test_launched_losses_equal_the_single_process_losses[[]dp2-*",
    "tests/test_training.py::test_launched_losses_equal_the_single_process_losses[[]tp2-*",
    "tests/test_training.py::test_launched_losses_equal_the_single_process_losses[[]hsdp2-*",
    "tests/test_huggingface.py::test_hf_llama_logits_and_gradients_equal_a_plain_step[[]cp2-*",  # cp1, cp2 stay
    "tests/test_huggingface.py::test_hf_llama_logits_and_gradients_equal_a_plain_step[[]tp2]",
    "tests/test_packed.py::test_packed_training_equals_the_documents_one_by_one[[]cp2-alltoall]",
    "tests/test_packed.py::test_packed_training_equals_the_documents_one_by_one[[]cp4-*",
    "tests/test_hf_zoo.py::*[[]cp2-alltoall-*",                     # the zoo at cp2 allgather stays
    "tests/test_hf_zoo.py::*[[]cp1-*",
    "tests/test_accelerate.py::test_the_guide_loop_under_cp_gives_the_one_process_losses[[]cp2-*",
    "tests/test_accelerate.py::test_the_guide_loop_under_cp_gives_the_one_process_losses[[]sp2-dp2-script]",
    # the guide's loop stays at sp2-cp2 (CP and Ulysses); its flags are read in test_accelerate_flags' dry runs
    "tests/test_accelerate.py::test_the_guide_loop_under_cp_gives_the_one_process_losses[[]cp2]",
    "tests/test_accelerate.py::test_the_guide_loop_under_cp_gives_the_one_process_losses[[]accelerate-flags]",
    "tests/test_accelerate.py::test_a_trainer_under_cp_gives_the_one_process_losses",  # run_clm's Trainer stays
    "tests/test_checkpointing.py::test_a_second_backward_recomputes_exactly[[]full]",  # [selective] stays
    # a checkpoint that cannot be written: the unwritable directory stays
    "tests/test_checkpoint.py::test_a_full_disk_is_one_line_and_the_latest_complete_checkpoint_stays",
    "tests/test_accelerate.py::test_what_the_script_and_the_launch_both_set_must_agree[[]cp_size]",
    "tests/test_accelerate.py::test_what_the_script_and_the_launch_both_set_must_agree[[]strategy]",
    "tests/test_accelerate.py::test_what_the_script_and_the_launch_both_set_must_agree[[]precision]",
    "tests/test_accelerate.py::test_nd_parallel_trainer_and_its_bf16",
    "tests/test_accelerate.py::test_a_model_prepared_twice_is_adopted_once",
    "tests/test_accelerate.py::test_evaluating_before_training_is_accelerates_one_line_as_on_gpus",
    "tests/test_ulysses_runtime.py::*[[]sp4*",                      # sp 2 x cp 2 stays
    "tests/test_ulysses_runtime.py::*[[]sp2-cp2-alltoall*",
    "tests/test_ulysses_runtime.py::*[[]sp2-dp_shard2*",
    "tests/test_trl.py::*",                                          # TRL's real sft script: slow to start
    "tests/test_accelerate.py::test_nd_parallel_with_its_cp_config_gives_the_one_process_losses",
    "tests/test_accelerate.py::test_what_the_script_and_the_launch_both_set_must_agree[[]sizes]",
    "tests/test_faults.py::test_a_killed_rank_is_restarted_and_the_run_resumes[[]1]",
    "tests/test_faults.py::test_a_killed_rank_is_restarted_and_the_run_resumes[[]2]",
    "tests/test_checkpoint.py::test_a_checkpoint_saved_at_cp2_dp2_resumes_at_cp4",
    "tests/test_checkpoint.py::test_an_asynchronous_checkpoint_resumes_like_a_blocking_one",
    "tests/test_launch.py::test_two_nodes_on_loopback",
    "tests/test_launch.py::test_with_restarts_each_failed_attempt_is_one_line",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="the full tier (what CI runs): every multi-process launch of the matrices, not one per capability")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in FULL_TIER_ONLY):
            item.add_marker(pytest.mark.full)
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full") is not None]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item.get_closest_marker("full") is None]
