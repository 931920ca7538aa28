"""The `cpctl` command line through typer's CliRunner: exit codes, one-line errors, dry-run
output, `check`, `env`, and the launcher at its boundary (torch.distributed.run.run patched,
as fastapi-cli patches uvicorn.run). Nothing here spawns a worker; tests/test_launch.py does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cpctl import __version__, versions
from cpctl.launch.cli import PROFILE_FLAGS, app
from cpctl.config import PROFILE_ENV_VAR
from launching import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

pytestmark = pytest.mark.usefixtures("isolated")


def cpctl(*args: str, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(app, list(args), env=env)


def assert_one_line_error(result: object, *fragments: str, code: int = 2) -> str:
    """Exit `code`, a single `error: ...` line on stderr naming `fragments`, no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def table_rows(text: str) -> dict[str, list[str]]:
    """Rich table rows of `text` by their first cell."""
    cells = [[cell.strip() for cell in line.split("│")] for line in text.splitlines() if "│" in line]
    return {row[0]: row[1:] for row in cells}


@pytest.fixture
def script(isolated: Path) -> Path:
    """A cpctl script (its source calls cpctl.init(), so `launch.script_api: auto` is cpctl)."""
    path = isolated / "train.py"
    path.write_text("import cpctl\n\nrt = cpctl.init()\n")
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- help, version, imports


def test_help_shows_no_type_after_plain_switches() -> None:
    for args in (["--help"], ["launch", "--help"], ["config", "--help"], ["check", "--help"]):
        assert "<bool>" not in cpctl(*args).stdout, args


def test_help_lists_the_commands() -> None:
    result = cpctl("--help")
    assert result.exit_code == 0
    for command in ("config", "launch", "check", "env"):
        assert command in result.output


def test_version() -> None:
    result = cpctl("--version")
    assert result.exit_code == 0 and result.output.strip() == f"cpctl {__version__}"


# What `python -c` runs: the CLI as `cpctl ARGS`, then report heavy modules that got imported.
_PROBE = """
import atexit, sys
atexit.register(lambda: sys.__stderr__.write(
    "\\nHEAVY=" + ",".join(m for m in ("torch", "questionary") if m in sys.modules) + "\\n"))
from cpctl.launch.cli import main
sys.argv = ["cpctl", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["launch", "--help"],
        ["config", "--help"],
        ["check", "--help"],
        ["env", "--help"],
        ["launch", "--dry-run", "--cp-size", "2", "train.py", "--steps", "5"],
        ["launch", "--dry-run", "--num-processes", "2", "--parallelism-config-cp-size", "2", "train.py"],
        ["check", "--static", "--profile", "cp8-allgather"],
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_fast_paths_do_not_import_torch(script: Path, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], check=False, capture_output=True, text=True, timeout=60,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "HEAVY=", proc.stderr


def test_launch_config_and_check_share_one_flag_set() -> None:
    """Pinned like torchtitan's test_no_new_cli_options: every flag is a promise."""
    command = typer.main.get_command(app)
    expected = {
        "--dp-replicate-size", "--dp-shard-size", "--cp-size", "--sp-size", "--tp-size", "--cp-comm-strategy",
        "--cp-load-balance", "--fsdp-version", "--reshard-after-forward", "--mixed-precision",
        "--activation-checkpointing", "--master-weights", "--device", "--nnodes", "--nproc-per-node",
        "--node-rank", "--rdzv-endpoint", "--max-restarts", "--comm-timeout", "--loss-chunk-tokens", "--checkpoint-level",
        "--selective-blocks",
        "--tiled-mlp-tokens", "--tiled-norm-tokens", "--offload-activations", "--cpu-offload", "--script-api", "--cp-engine", "--model",
    }
    # accelerate launch's flags for what cpctl has (its underscore spellings match as dashes)
    accelerate = {
        "--parallelism-config-dp-replicate-size", "--parallelism-config-dp-shard-size", "--parallelism-config-tp-size",
        "--parallelism-config-cp-size", "--parallelism-config-cp-comm-strategy", "--parallelism-config-cp-backend",
        "--num-processes", "--num-machines", "--machine-rank", "--main-process-ip", "--main-process-port",
        "--max-restarts", "--cpu", "--multi-gpu", "--mixed-precision", "--fsdp-version", "--fsdp-reshard-after-forward",
        "--fsdp-activation-checkpointing", "--fsdp-offload-params", "--use-fsdp", "--use-parallelism-config",
        "--parallelism-config-sp-size", "--parallelism-config-sp-attn-implementation", "--parallelism-config-sp-backend",
        "--parallelism-config-sp-seq-length", "--parallelism-config-sp-seq-length-is-variable",
    }
    accelerate -= expected  # --max-restarts, --mixed-precision, --fsdp-version: cpctl's own already
    own = {
        "launch": {"--module", "-m", "--config", "-c", "--profile", "-p", "--dry-run", "--help"} | accelerate,
        "check": {"--config", "-c", "--profile", "-p", "--static", "--help"},
        "config": {"--output", "-o", "--yes", "-y", "--from-accelerate", "--help"},
    }
    assert {spec.flag for spec in PROFILE_FLAGS} == expected
    for name, extra in own.items():
        options = {opt for param in command.commands[name].get_params(command.make_context("cpctl", ["--help"], resilient_parsing=True)) for opt in param.opts if opt.startswith("-")}
        assert options == expected | extra, name


# ----------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--cp-size", "two"], ["flag --cp-size: 'two' is not allowed for parallelism.cp_size; expected an integer >= 1"]),
        (["--cp-comm-strategy", "ring"], ["'ring' is not allowed", "expected allgather or alltoall"]),
        (["--nproc-per-node", "8", "--cp-size", "2", "--dp-shard-size", "2"],
         ["dp_replicate(1) * dp_shard(2) * cp(2) * tp(1) = 4 != world size 8", "set dp_shard_size: 4"]),
        (["--cp-size", "2", "--fsdp-version", "1"], ["context parallelism needs fsdp.version: 2"]),
        (["--nnodes", "2"], ["pass --rdzv-endpoint HOST:PORT"]),
        (["--attention", "sdpa"], ["--attention: unknown option: a retired key", "SDPA at every cp and sp size", "; drop the flag"]),
        (["--profile", "cpu-tri"], ["no such profile; did you mean cpu-try?"]),
        (["--cp-sise", "2"], ["--cp-sise: unknown option; did you mean --cp-size?"]),
        (["--nproc", "2"], ["--nproc: unknown option; did you mean --nproc-per-node?"]),  # an abbreviation
        (["--profile", "./configs/cpu-try.yaml"], ["--profile takes a profile's name", "use --config ./configs/cpu-try.yaml"]),
    ],
    ids=lambda value: value[0] if isinstance(value, list) and value and value[0].startswith("--") else None,
)
def test_bad_flags(script: Path, args: list[str], fragments: list[str]) -> None:
    assert_one_line_error(cpctl("launch", "--dry-run", *args, "train.py"), *fragments)


def test_the_dry_run_says_what_the_workers_train_in_and_where_that_came_from(isolated: Path, script: Path) -> None:
    """An accelerate config file's mixed_precision: bf16 trains a script that never asked for bf16 in bf16: said."""
    write(isolated / "cp.yaml", "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\n"
                                "fsdp_config:\n  fsdp_version: 2\nparallelism_config:\n  parallelism_config_cp_size: 2\n")
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--config", "cp.yaml", "--script-api", "accelerate", "train.py")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("Precision:"))
    assert line == ("Precision: bf16 compute, fp32 gradient reduction (fsdp.mixed_precision bf16, from --config "
                    "cp.yaml); fp32 master weights and optimizer state"), line


def test_a_launch_without_cp_says_so_first(script: Path) -> None:
    without = cpctl("launch", "--dry-run", "--device", "cpu", "train.py")
    assert without.exit_code == 0 and without.stdout.startswith(
        "note: cp_size 1: the 2 ranks split batches, not sequences"), without.stdout
    with_cp = cpctl("launch", "--dry-run", "--device", "cpu", "--cp-size", "2", "train.py")
    assert with_cp.exit_code == 0 and "split batches, not sequences" not in with_cp.stdout
    # one process: nothing to split with, and its attention runs on cpctl's engine all the same
    alone = cpctl("launch", "--dry-run", "--device", "cpu", "--nproc-per-node", "1", "train.py")
    assert alone.exit_code == 0 and "note:" not in alone.stdout, alone.stdout


@pytest.mark.parametrize(("visible", "fragments"), [
    ("", ["launch.device is cuda but no GPU is visible", "--device cpu"]),
    ("0,1", ["4 workers but 2 GPUs visible; use --nproc-per-node 2 or fewer"]),
])
def test_a_gpu_profile_is_previewed_anywhere_but_launched_only_where_it_fits(script: Path, visible: str,
                                                                             fragments: list[str]) -> None:
    args = ("--device", "cuda", "--nproc-per-node", "4", "train.py")
    preview = cpctl("launch", "--dry-run", *args, env={"CUDA_VISIBLE_DEVICES": visible})
    assert preview.exit_code == 0, preview.output
    assert "as on a node with 4 GPUs (nproc_per_node as given)" in preview.stdout
    assert "cp 1 x dp_shard 4 = world 4" in preview.stdout or "world 4" in preview.stdout
    assert "Here it would not launch:" in preview.stdout and all(f in preview.stdout for f in fragments)
    assert_one_line_error(cpctl("launch", *args, env={"CUDA_VISIBLE_DEVICES": visible}), *fragments)


def test_one_gpu_is_one_gpu(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "--device", "cuda", "--nproc-per-node", "1", "train.py")
    assert result.exit_code == 0, result.output
    assert "as on a node with 1 GPU (nproc_per_node as given)" in result.stdout and "1 GPUs" not in result.output


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("parallelism:\n  cp_sise: 2\n", ["parallelism.cp_sise: unknown key; did you mean cp_size?"]),
        ("parallelism:\n  cp_size: two\n", ["parallelism.cp_size: 'two' is not allowed; expected an integer >= 1"]),
        ("parallelism:\n  cp_size: [2\n", ["broken YAML (line 3, column 1)"]),
        ("parallelism: {cp_comm_strategy: ring}\n", ["parallelism.cp_comm_strategy: 'ring' is not allowed"]),
        ("parallelism: {cp_size: 2}\nfsdp: {version: 1}\n", ["fsdp.version: 1 with cp_size 2"]),
        ("parallelism: {cp_size: 2}\nattention: flash_attention_2\n", ["attention: flash_attention_2: a retired key", "delete the line"]),
        ("version: 3\n", ["version: 3 is not allowed; expected 1"]),
    ],
    ids=["unknown-key", "wrong-type", "broken-yaml", "bad-strategy", "cp-fsdp1", "retired-attention", "version"],
)
def test_bad_profile_files(script: Path, text: str, fragments: list[str]) -> None:
    bad = write(script.parent / "bad.yaml", text)
    line = assert_one_line_error(cpctl("launch", "--dry-run", "--config", "bad.yaml", "train.py"), *fragments)
    if "with cp_size" not in line:  # rules across keys judge the merged profile, not one file
        assert line.startswith(f"error: {bad}: ")
    assert_one_line_error(cpctl("check", "--config", "bad.yaml"), *fragments)


def test_bad_local_profile_is_named(script: Path) -> None:
    write(script.parent / "cpctl.yaml", "launch: {nproc_per_node: 0}\n")
    assert_one_line_error(cpctl("launch", "--dry-run", "train.py"), "cpctl.yaml: launch.nproc_per_node: 0 is not allowed")


def test_bad_environment_variable(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "train.py", env={"CPCTL_CP_SIZE": "abc"})
    assert_one_line_error(result, "env CPCTL_CP_SIZE: 'abc' is not allowed for parallelism.cp_size")
    result = cpctl("launch", "--dry-run", "train.py", env={"CPCTL_CPSIZE": "2"})
    assert_one_line_error(result, "CPCTL_CPSIZE: unknown variable; did you mean CPCTL_CP_SIZE?")


def test_missing_script(isolated: Path) -> None:
    (isolated / "train.py").write_text("")
    assert_one_line_error(cpctl("launch", "--dry-run", "trian.py"), "trian.py: no such script; did you mean train.py?")
    assert_one_line_error(cpctl("launch", "--dry-run", "nothing/here.py"), "nothing/here.py: no such script")
    assert_one_line_error(cpctl("launch", "--dry-run"), "no script given")


def test_missing_module(isolated: Path) -> None:
    assert_one_line_error(cpctl("launch", "--dry-run", "-m", "no_such_mod_xyz"), "-m no_such_mod_xyz: no module named 'no_such_mod_xyz'")
    (isolated / "pkg").mkdir()
    (isolated / "pkg" / "__init__.py").write_text("raise SystemExit('must not be imported by the check')\n")
    assert_one_line_error(cpctl("launch", "--dry-run", "-m", "pkg.train"), "no module named 'pkg.train'")


def test_old_torch_is_refused(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.5.1" if name == "torch" else real(name))
    assert_one_line_error(cpctl("launch", "--dry-run", "train.py"), "torch 2.5.1 is too old", "torch>=2.6")
    result = cpctl("check", "--device", "cpu")
    assert_one_line_error(result, "torch 2.5.1 is too old")
    assert "FAIL" in result.stdout


def test_torch_version_parsing() -> None:
    assert versions.parse_version("2.13.0+cpu") == (2, 13)
    assert versions.torch_problem("2.6.0.dev20241001") is None
    assert "not installed" in versions.torch_problem(None)


# ----------------------------------------------------------------------------- dry run


def test_dry_run_shows_profile_sources_mesh_and_command(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--nproc-per-node", "4", "--cp-size", "2",
                   "train.py", "--steps", "5", env={"CPCTL_CP_COMM_STRATEGY": "alltoall"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Resolved profile" in out and "Mesh layout" in out
    rows = table_rows(out)
    assert rows["parallelism.cp_size"] == ["2", "flag --cp-size"]
    assert rows["parallelism.cp_comm_strategy"] == ["alltoall", "env CPCTL_CP_COMM_STRATEGY"]
    # "alltoall" is PyTorch's name; what it does is said, so it is not taken for Ulysses' all-to-all
    assert "K/V across cp: ring rotation: K/V blocks pass around the CP ranks" in out and "Heads across sp" not in out
    assert rows["parallelism.dp_shard_size"] == ["2", "auto (world 4 / 2)"]
    assert rows["parallelism.tp_size"] == ["1", "default"]
    # mesh: rank -> node, local rank, dp_replicate, dp_shard, cp, sp, tp
    assert [rows[str(rank)] for rank in range(4)] == [
        ["0", "0", "0", "0", "0", "0", "0"], ["0", "1", "0", "0", "1", "0", "0"],
        ["0", "2", "0", "1", "0", "0", "0"], ["0", "3", "0", "1", "1", "0", "0"],
    ]
    assert "torchrun --nnodes=1 --nproc-per-node=4 --max-restarts=0 --standalone --tee=3 -- train.py --steps 5" in out
    assert f"{PROFILE_ENV_VAR}='{{\"version\":1," in out


def test_the_dry_run_says_which_api_the_script_uses_and_why(isolated: Path) -> None:
    write(isolated / "acc.py", "from accelerate import Accelerator\naccelerator = Accelerator()\n")
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--cp-size", "2", "acc.py", "--lr", "1")
    assert result.exit_code == 0, result.output
    assert table_rows(result.stdout)["launch.script_api"] == ["accelerate", "auto (acc.py:2 builds an Accelerator)"]
    assert "Script: an accelerate script" in result.stdout and "(launch.script_api accelerate; auto: acc.py:2" in result.stdout
    assert "--tee=3 --module -- cpctl.integrations.accelerate_shim acc.py --lr 1" in result.stdout


def test_a_script_of_neither_api_is_refused_under_cp(isolated: Path) -> None:
    write(isolated / "plain.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    assert_one_line_error(cpctl("launch", "--dry-run", "--device", "cpu", "--cp-size", "2", "plain.py"),
                          "plain.py: neither cpctl.init() nor an Accelerator or Trainer found (read 1 file)",
                          "pass --script-api cpctl")
    result = cpctl("launch", "--dry-run", "--device", "cpu", "plain.py")  # no CP: nothing to set up wrongly
    assert result.exit_code == 0 and table_rows(result.stdout)["launch.script_api"][0] == "cpctl"
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--cp-size", "2", "--script-api", "cpctl", "plain.py")
    assert result.exit_code == 0 and table_rows(result.stdout)["launch.script_api"] == ["cpctl", "flag --script-api"]


def test_dry_run_says_which_blocks_the_mixed_level_makes_selective(script: Path) -> None:
    on = ["launch", "--dry-run", "--device", "cpu", "--activation-checkpointing", "true", "--checkpoint-level", "mixed"]
    fit = cpctl(*on, "train.py")
    assert fit.exit_code == 0, fit.output
    assert "selective for as many blocks as fit, chosen at the first step" in " ".join(fit.stdout.split())
    pinned = cpctl(*on, "--selective-blocks", "3", "train.py")
    assert "Checkpointing: selective for the last 3 blocks, full for the rest." in pinned.stdout


@pytest.mark.parametrize(("node_rank", "hosts", "ranks"), [
    ("1", "false", "ranks 2-3; global rank 0 (it writes checkpoints, saved models and logs) runs on node rank 0."),
    ("0", "true", "ranks 0-1; global rank 0 (it writes checkpoints, saved models and logs) runs here."),
])
def test_dry_run_multi_node(script: Path, node_rank: str, hosts: str, ranks: str) -> None:
    # torchrun ignores --node-rank under c10d; node_rank 0 hosts the rendezvous store (c10d's is_host)
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--nnodes", "2", "--node-rank", node_rank,
                   "--rdzv-endpoint", "10.0.0.1:29400", "--nproc-per-node", "2", "--cp-size", "4", "train.py")
    assert result.exit_code == 0, result.output
    assert ("torchrun --nnodes=2 --nproc-per-node=2 --max-restarts=0 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 "
            f"--rdzv-conf=is_host={hosts} --tee=3 -- train.py") in result.stdout
    assert "--standalone" not in result.stdout and "--node-rank" not in result.stdout.split("torchrun")[-1]
    # which machine runs which ranks, and that plain torchrun would not place them so
    shown = " ".join(result.stdout.split())
    assert f"this one, node rank {node_rank}, runs {ranks}" in shown
    assert "plain torchrun's c10d ignores --node-rank and sorts the machines by host name" in shown


def test_a_default_node_rank_leaves_the_store_host_to_c10d(script: Path) -> None:
    # a node rank nobody gave says nothing about which machine is the endpoint: no is_host
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400",
                   "--nproc-per-node", "2", "--cp-size", "4", "train.py")
    assert result.exit_code == 0, result.output
    assert ("--rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --tee=3 -- train.py") in result.stdout
    # nor which ranks it runs: the dry run says so, and how to decide
    assert ("this machine was given no node rank of its own (--node-rank, CPCTL_NODE_RANK, SLURM), so it takes a "
            "place no machine was given") in " ".join(result.stdout.split())


SHARED_TWO_NODES = "version: 1\nlaunch:\n  device: cpu\n  nnodes: 2\n  nproc_per_node: 2\n  node_rank: 0\n" \
                   "  rdzv_endpoint: 10.0.0.1:29400\n"
ACCELERATE_TWO_MACHINES = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 2\nnum_processes: 4\n" \
                          "main_process_ip: 10.0.0.1\nmain_process_port: 29400\n"


@pytest.mark.parametrize(("file", "text", "env", "hosts"), [
    # a profile every machine launches says nothing about which machine this is: c10d's own rule
    ("shared.yaml", SHARED_TWO_NODES, {}, None),
    ("shared.yaml", SHARED_TWO_NODES, {"CPCTL_NODE_RANK": "1"}, "false"),  # the machine's own variable does
    ("shared.yaml", SHARED_TWO_NODES, {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0"}, "true"),
    # accelerate writes its config file per machine: its machine_rank is this machine's, when it has one
    ("accelerate.yaml", ACCELERATE_TWO_MACHINES, {}, None),
    ("accelerate.yaml", ACCELERATE_TWO_MACHINES + "machine_rank: 1\n", {}, "false"),
])
def test_only_this_machines_own_node_rank_picks_the_rendezvous_host(script: Path, file: str, text: str,
                                                                    env: dict[str, str], hosts: str | None) -> None:
    config = write(script.parent / file, text)
    result = cpctl("launch", "--dry-run", "--config", str(config), "train.py", env=env)
    assert result.exit_code == 0, result.output
    is_host = "" if hosts is None else f"--rdzv-conf=is_host={hosts} "
    assert f"--rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 {is_host}--tee=3 " in result.stdout


def test_dry_run_under_slurm(script: Path) -> None:
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[003-004]"}
    result = cpctl("launch", "--dry-run", "--device", "cpu", "train.py", env=slurm)
    assert result.exit_code == 0, result.output
    assert "--nnodes=2" in result.stdout and "--rdzv-endpoint=gpu003:29500" in result.stdout
    assert "│ SLURM" in result.stdout


def test_dry_run_truncates_a_large_mesh(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--nnodes", "16", "--rdzv-endpoint", "h:1",
                   "--nproc-per-node", "8", "--cp-size", "8", "--tp-size", "2", "train.py")
    assert result.exit_code == 0, result.output
    assert "108 ranks not shown" in result.stdout
    rows = table_rows(result.stdout)
    assert rows["15"] == ["1", "7", "0", "0", "7", "0", "1"] and "16" not in rows and "…" in rows
    assert rows["127"] == ["15", "7", "0", "7", "7", "0", "1"]


def test_dry_run_with_a_module(isolated: Path) -> None:
    (isolated / "pkg").mkdir()
    (isolated / "pkg" / "__init__.py").write_text("raise SystemExit('must not be imported by the check')\n")
    (isolated / "pkg" / "train.py").write_text("")
    result = cpctl("launch", "--dry-run", "-m", "pkg.train", "--lr", "1")
    assert result.exit_code == 0, result.output
    assert "--tee=3 --module -- pkg.train --lr 1" in result.stdout


def test_everything_after_the_script_is_the_scripts(script: Path, torchrun: TorchrunSpy) -> None:
    # as with torchrun, accelerate launch and python: a cpctl option after SCRIPT, a `--`, an
    # abbreviation of a torchrun option (`--log`) all reach the script unchanged
    after = ["--log", "x", "--nnodes", "3", "--cp-size", "8", "--dry-run", "--", "--config", "y"]
    result = cpctl("launch", "--device", "cpu", "train.py", *after)
    assert result.exit_code == 0, result.output
    [(args, environ)] = torchrun.calls
    assert (args.training_script, args.training_script_args) == ("train.py", after)
    sent = json.loads(environ[PROFILE_ENV_VAR])
    assert (sent["launch"]["nnodes"], sent["parallelism"]["cp_size"]) == (1, 1)  # cpctl took none of them
    # train.py mentions none of cpctl's options: a note says where they were meant to go
    note = " ".join(result.stderr.split())
    assert ("note: --nnodes, --cp-size, --dry-run after train.py go to the script, which does not mention them; "
            "cpctl's options go before SCRIPT: cpctl launch --nnodes 3 --cp-size 8 --dry-run train.py ...") in note


def test_the_note_takes_a_switch_alone(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "--device", "cpu", "train.py", "--cpu", "3")  # accelerate's --cpu: no value
    assert result.exit_code == 0, result.output
    assert ("note: --cpu after train.py goes to the script, which does not mention it; cpctl's options go before "
            "SCRIPT: cpctl launch --cpu train.py ...") in " ".join(result.stderr.split())
    assert "-- train.py --cpu 3" in result.stdout


def test_no_note_for_options_the_script_takes(script: Path) -> None:
    script.write_text("import argparse, cpctl\nargparse.ArgumentParser().add_argument('--nnodes')\ncpctl.init()\n")
    result = cpctl("launch", "--dry-run", "--device", "cpu", "train.py", "--nnodes", "3")
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr and "-- train.py --nnodes 3" in result.stdout


def test_a_misspelt_option_before_the_script_is_one_line(script: Path) -> None:
    assert_one_line_error(cpctl("launch", "--cp-sise", "2", "train.py", "--lr", "1"),
                          "--cp-sise: unknown option; did you mean --cp-size?")


@pytest.mark.parametrize(("args", "fragments"), [
    (["config", "--yes", "--cp-sise", "2"], ["No such option: --cp-sise", "--cp-size", "see cpctl config --help"]),
    (["check", "--cp-sise", "2"], ["No such option: --cp-sise", "see cpctl check --help"]),
    (["env", "--bogus"], ["No such option: --bogus", "see cpctl env --help"]),
    (["lanch"], ["No such command 'lanch'", "Did you mean 'launch'", "See cpctl --help."]),
    (["--bogus"], ["No such option: --bogus", "see cpctl --help"]),
    (["plan", "--model", "1b", "--seq-len"], ["Option '--seq-len' requires an argument"]),
    (["launch", "--dry-run", "--nproc-per-node"], ["Option '--nproc-per-node' requires an argument"]),
])
def test_what_the_command_line_parser_itself_refuses_is_one_line(args: list[str], fragments: list[str]) -> None:
    """click's own errors (before cpctl sees the values) are the same one line as cpctl's, not a boxed block."""
    result = cpctl(*args)
    assert_one_line_error(result, *fragments)
    assert "Usage:" not in result.output and "\u256d" not in result.output  # no usage block, no box


# ----------------------------------------------------------------------------- the launcher boundary


class TorchrunSpy:
    """Stands in for torch.distributed.run.run: records what it was given and the environment
    its workers would inherit, then does what it is told."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.writes: dict[str, str] = {}  # files the "workers" leave in CPCTL_ERROR_DIR
        self.calls: list[tuple[object, dict[str, str]]] = []

    def __call__(self, args: object) -> None:
        self.calls.append((args, dict(os.environ)))
        for name, text in self.writes.items():
            path = Path(os.environ["CPCTL_ERROR_DIR"]) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if self.raises is not None:
            raise self.raises


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> TorchrunSpy:
    import torch.distributed.run

    spy = TorchrunSpy()
    monkeypatch.setattr(torch.distributed.run, "run", spy)
    return spy


def test_launch_hands_torchrun_its_own_parsed_args(script: Path, torchrun: TorchrunSpy) -> None:
    result = cpctl("launch", "--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "train.py", "--lr", "1e-3", "-x")
    assert result.exit_code == 0, result.output
    [(args, environ)] = torchrun.calls
    # torchrun's --standalone, with its stores on 127.0.0.1 (cpctl.launch.loopback)
    assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.standalone) == ("1", "2", 0, False)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.local_addr) == ("cpctl-loopback", "127.0.0.1:0", "127.0.0.1")
    assert (args.tee, args.module) == ("3", False)
    assert (args.training_script, args.training_script_args) == ("train.py", ["--lr", "1e-3", "-x"])
    sent = json.loads(environ[PROFILE_ENV_VAR])
    assert sent["parallelism"] | {} == {"dp_replicate_size": 1, "dp_shard_size": 1, "cp_size": 2, "sp_size": 1,
                                        "tp_size": 1, "cp_comm_strategy": "allgather", "cp_engine": "cpctl", "cp_load_balance": True}
    assert sent["launch"]["device"] == "cpu" and sent["fsdp"]["mixed_precision"] == "no"
    assert environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "
    assert PROFILE_ENV_VAR not in os.environ  # set for the launch only


def test_launch_torchrun_config_keeps_torchrun_defaults(script: Path, torchrun: TorchrunSpy) -> None:
    from torch.distributed.run import config_from_args

    assert cpctl("launch", "--device", "cpu", "--nproc-per-node", "3", "--cp-size", "3", "train.py").exit_code == 0
    [(args, _)] = torchrun.calls
    config, command, command_args = config_from_args(args)
    assert (config.nproc_per_node, config.max_restarts, config.min_nodes, config.max_nodes) == (3, 0, 1, 1)
    assert command == sys.executable and command_args == ["-u", "train.py"]


def test_launch_multi_node_uses_c10d(script: Path, torchrun: TorchrunSpy) -> None:
    result = cpctl("launch", "--device", "cpu", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29400",
                   "--nproc-per-node", "1", "--max-restarts", "2", "-m", "train")
    assert result.exit_code == 0, result.output
    [(args, _)] = torchrun.calls
    # c10d, as cpctl's backend that places the machines by node rank (cpctl.launch.rendezvous)
    assert (args.nnodes, args.standalone, args.rdzv_backend, args.rdzv_endpoint) == ("2", False, "cpctl-c10d",
                                                                                       "head:29400")
    assert (args.max_restarts, args.module, args.training_script) == (2, True, "train")
    # node_rank 1 never hosts the rendezvous store, whatever its host name: what c10d's store reads
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.run import config_from_args

    config = config_from_args(args)[0]
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
                                  config.max_nodes, **config.rdzv_configs)
    assert params.get_as_bool("is_host") is False and params.get_as_int("node_rank") == 1


def _child_failed(*failures: tuple[int, int]) -> BaseException:
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    found = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
             for rank, code in failures}
    return ChildFailedError(name="train.py", failures=found)


@pytest.mark.parametrize(
    ("raised", "code", "fragments"),
    [
        (lambda: _child_failed((1, 3)), 3, ["worker rank 1 (local rank 1, pid 1001) exited with code 3"]),
        (lambda: _child_failed((0, -signal.SIGKILL)), 128 + signal.SIGKILL, ["worker rank 0", "was killed by SIGKILL"]),
        (lambda: _child_failed((2, 7), (0, 1)), 7, ["worker rank 2", "code 7", "and 1 more rank after it"]),
        (lambda: __import__("torch.distributed.elastic.multiprocessing.api", fromlist=["x"]).SignalException("x", signal.SIGINT),
         130, ["interrupted by SIGINT; workers stopped"]),
        (lambda: KeyboardInterrupt(), 130, ["interrupted; workers stopped"]),
        (lambda: __import__("torch.distributed.elastic.rendezvous.api", fromlist=["x"]).RendezvousTimeoutError("timed out"),
         1, ["rendezvous failed: timed out", "--rdzv-endpoint"]),
    ],
    ids=["exit-3", "killed", "first-of-two", "sigint", "keyboard-interrupt", "rendezvous"],
)
def test_launch_failures_exit_with_the_workers_code(script: Path, torchrun: TorchrunSpy, raised, code: int, fragments: list[str]) -> None:
    torchrun.raises = raised()
    result = cpctl("launch", "--device", "cpu", "--nproc-per-node", "2", "train.py")
    assert_one_line_error(result, *fragments, code=code)


@pytest.mark.parametrize(("raised", "left"), [
    (None, []),
    (lambda: SystemExit(2), []),  # e.g. torchrun's own parser refusing its argv
    (lambda: RuntimeError("the agent broke"), []),
    (lambda: _child_failed((1, 3)), []),  # a worker exited: no traceback file
    (lambda: _child_failed((1, 1)), ["rank1-traceback.txt"]),  # ... named by the error: kept, alone
])
def test_a_launch_leaves_only_the_traceback_files_it_names(script: Path, torchrun: TorchrunSpy, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, raised, left: list[str]) -> None:
    import tempfile

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    torchrun.raises = raised() if raised else None
    torchrun.writes = {"torchrun/attempt_0/1/stderr.log": "what the console showed"}
    if left:
        torchrun.writes |= {name: "Traceback (most recent call last):" for name in left}
    cpctl("launch", "--device", "cpu", "--nproc-per-node", "2", "train.py")
    kept = list(temp.glob("cpctl-*"))
    assert [path.name for directory in kept for path in directory.iterdir()] == left


# ----------------------------------------------------------------------------- check and env


def test_check_passes_on_a_cpu_profile(script: Path) -> None:
    result = cpctl("check", "--device", "cpu", "--cp-size", "2")
    assert result.exit_code == 0, result.output
    for row in ("profile", "torch >= 2.6", "devices", "backend"):
        assert row in result.stdout
    assert "gloo available" in result.stdout and "FAIL" not in result.stdout


def test_check_fails_on_a_bad_profile(script: Path) -> None:
    result = cpctl("check", "--device", "cpu", "--cp-size", "3")
    assert_one_line_error(result, "dp_replicate(1) * cp(3) * tp(1) = 3 does not divide world size 2")
    assert "FAIL" in result.stdout and "skipped (invalid profile)" in result.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_every_shipped_profile_passes_static_check(config: Path) -> None:
    result = cpctl("check", "--static", "--profile", config.stem)
    assert result.exit_code == 0, result.output
    assert "--static: validated as on" in result.stdout


def test_static_is_what_lets_a_cuda_profile_pass_here() -> None:
    # isolated hides every GPU: the same profile fails a plain check
    assert_one_line_error(cpctl("check", "--profile", "cp8-allgather"), "no GPU is visible")
    result = cpctl("check", "--static", "--profile", "cp8-allgather")
    assert result.exit_code == 0 and "a node with 8 GPUs (nproc_per_node as given)" in result.stdout
    # static still catches what is wrong on any machine
    assert_one_line_error(cpctl("check", "--static", "--profile", "cp8-allgather", "--cp-size", "3"), "!= world size 8")


def test_env_reports_versions_devices_backends_and_profile(isolated: Path) -> None:
    result = cpctl("env")
    assert result.exit_code == 0, result.output
    for word in ("versions", "python", "torch", "typer", "devices", "cpu", "backends", "gloo", "built-in defaults"):
        assert word in result.stdout, word
    from importlib.metadata import version  # the libraries a bug report needs, as installed

    for name in ("transformers", "accelerate", "trl", "peft", "datasets", "safetensors"):
        line = next(line for line in result.stdout.splitlines() if f" {name} " in line)
        assert version(name) in line, line
    write(isolated / "cpctl.yaml", "parallelism: {cp_size: 2}\n")
    result = cpctl("env", env={"CPCTL_MAX_RESTARTS": "1"})
    assert str(isolated / "cpctl.yaml") in result.stdout and "CPCTL_MAX_RESTARTS=1" in result.stdout
    assert "cp 2 = world 2" in result.stdout


# ----------------------------------------------------------------------------- config (the wizard)


def test_config_yes_writes_a_profile_that_checks(isolated: Path) -> None:
    result = cpctl("config", "--yes", "--output", "cp.yaml", "--device", "cpu", "--cp-size", "2")
    assert result.exit_code == 0, result.output
    assert (isolated / "cp.yaml").is_file()
    assert cpctl("check", "--config", "cp.yaml").exit_code == 0
    dry = cpctl("launch", "--dry-run", "--config", "cp.yaml", "--script-api", "cpctl", "--module", "json.tool")
    assert "cp 2 = world 2" in dry.stdout


def test_config_rejects_a_bad_flag_in_one_line(isolated: Path) -> None:
    assert_one_line_error(cpctl("config", "--yes", "--cp-size", "two"), "two")
    assert not (isolated / "cpctl.yaml").exists()


def test_dry_run_says_what_ulysses_does(script: Path) -> None:
    result = cpctl("launch", "--dry-run", "--device", "cpu", "--nproc-per-node", "4", "--sp-size", "2", "--cp-size", "2",
                   "train.py")
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert rows["parallelism.sp_size"] == ["2", "flag --sp-size"]
    assert rows["parallelism.dp_shard_size"] == ["1", "auto (world 4 / 4)"]
    # rank -> node, local rank, dp_replicate, dp_shard, cp, sp, tp: sp peers are neighbours
    assert [rows[str(rank)][4:6] for rank in range(4)] == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]
    text = " ".join(result.stdout.split())
    assert "Ulysses: sp 2 on consecutive ranks, inside one node, the allgather ring over cp 2 outside it" in text
    assert "K/V heads fewer than 2 are repeated, exactly" in text
    assert "split batches, not sequences" not in text
    wide = cpctl("launch", "--dry-run", "--device", "cpu", "--nnodes", "2", "--rdzv-endpoint", "h:1",
                 "--nproc-per-node", "2", "--sp-size", "4", "train.py")
    assert wide.exit_code == 0, wide.output
    assert "across nodes (sp x tp = 4 > 2 processes per node" in " ".join(wide.stdout.split())
    bad = cpctl("launch", "--dry-run", "--device", "cpu", "--nproc-per-node", "4", "--sp-size", "3", "train.py")
    assert bad.exit_code == 2 and "sp(3)" in bad.output


def test_more_cpu_processes_than_cores_are_said_before_they_start(script: Path, torchrun: TorchrunSpy,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    result = cpctl("launch", "--device", "cpu", "--nproc-per-node", "8", "--cp-size", "2", "train.py")
    assert result.exit_code == 0, result.output
    assert "note: 8 CPU processes on 2 cores: each gets 0.25 of a core" in result.stdout
    assert "--nproc-per-node 2 or fewer" in result.stdout and len(torchrun.calls) == 1
    quiet = cpctl("launch", "--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2", "train.py")
    assert quiet.exit_code == 0 and "CPU processes on" not in quiet.output
