"""`accelerate launch`'s flags on `cpctl launch`: the same meaning, the same validation, shown with
their source by --dry-run; the ones cpctl cannot honour are one line each. Through typer's
CliRunner and dry runs: nothing is spawned, torch is not needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import assert_one_line_error, cpctl, table_rows

from cpctl.launch.accelerate_flags import ALIASES, CANNOT_HONOUR

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def script(isolated: Path) -> Path:
    path = isolated / "train.py"
    path.write_text("import cpctl\n\nrt = cpctl.init()\n")
    return path


def dry_run(*args: str) -> tuple[dict[str, list[str]], str]:
    result = cpctl("launch", "--dry-run", *args, "train.py", "--lr", "1")
    assert result.exit_code == 0, result.output
    return table_rows(result.stdout), result.stdout


def test_a_seed_command_line_with_the_launchers_name_changed(script: Path) -> None:
    # accelerate launch's own spelling (underscores), two machines of 2 processes, this one rank 1
    rows, out = dry_run("--cpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
                        "--main_process_ip", "10.0.0.1", "--main_process_port", "29400", "--use_fsdp",
                        "--fsdp_version", "2", "--mixed_precision", "no", "--parallelism_config_cp_size", "2",
                        "--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_comm_strategy", "alltoall")
    assert rows["launch.nproc_per_node"] == ["2", "flag --num-processes 4 (the total over 2 machines)"]
    assert rows["launch.nnodes"] == ["2", "flag --num-machines"]
    assert rows["launch.node_rank"] == ["1", "flag --machine-rank"]
    assert rows["launch.rdzv_endpoint"] == ["10.0.0.1:29400", "flag --main-process-ip --main-process-port"]
    assert rows["launch.device"] == ["cpu", "flag --cpu"]
    assert rows["parallelism.cp_size"] == ["2", "flag --parallelism-config-cp-size"]
    assert rows["parallelism.dp_shard_size"] == ["2", "flag --parallelism-config-dp-shard-size"]
    assert rows["parallelism.cp_comm_strategy"] == ["alltoall", "flag --parallelism-config-cp-comm-strategy"]
    assert rows["fsdp.version"] == ["2", "flag --fsdp-version"] and rows["fsdp.mixed_precision"] == ["no", "flag --mixed-precision"]
    assert "--use-fsdp: what cpctl always does" in out
    assert ("torchrun --nnodes=2 --nproc-per-node=2 --max-restarts=0 --rdzv-backend=c10d "
            "--rdzv-endpoint=10.0.0.1:29400 --rdzv-conf=is_host=false --tee=3 -- train.py --lr 1") in out


def test_accelerates_sequence_parallelism_is_cpctls_ulysses(script: Path) -> None:
    """accelerate launch's sp flags (DeepSpeed's Ulysses there) set cpctl's sp_size; what DeepSpeed
    must be told in advance is accepted with a note, a backend other than deepspeed is refused."""
    rows, out = dry_run("--cpu", "--num_processes", "4", "--parallelism_config_sp_size", "2",
                        "--parallelism_config_cp_size", "2", "--parallelism_config_sp_backend", "deepspeed",
                        "--parallelism_config_sp_seq_length", "4096", "--parallelism_config_sp_attn_implementation", "sdpa")
    assert rows["parallelism.sp_size"] == ["2", "flag --parallelism-config-sp-size"]
    assert "attention" not in rows
    assert "--parallelism-config-sp-attn-implementation: sdpa: how cpctl computes attention" in out
    assert "--parallelism-config-sp-seq-length: what DeepSpeed's Ulysses needs to know in advance" in out
    assert "--parallelism-config-sp-backend: deepspeed: accelerate's only backend for sp" in out
    assert_one_line_error(cpctl("launch", "--dry-run", "--cpu", "--parallelism_config_sp_backend", "ring", "train.py"),
                          "flag --parallelism-config-sp-backend: 'ring' is not allowed; expected deepspeed")
    assert_one_line_error(cpctl("launch", "--dry-run", "--cpu", "--num_processes", "2", "--parallelism_config_sp_size",
                                "2", "--parallelism_config_sp_attn_implementation", "flash_attention_2", "train.py"),
                          "flag --parallelism-config-sp-attn-implementation: 'flash_attention_2' is not allowed; "
                          "expected sdpa")


ACCELERATE_SP = ("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 4\nparallelism_config:\n"
                 "  parallelism_config_sp_size: 2\n  parallelism_config_cp_size: 2\n"
                 "  parallelism_config_sp_backend: deepspeed\n  parallelism_config_sp_seq_length: 4096\n")


def test_accelerates_config_file_sets_sequence_parallelism_as_its_flags_do(script: Path) -> None:
    """The same setting in accelerate's config file means what its flag means: sp_size is cpctl's
    Ulysses, and an attention other than sdpa is refused, in one line."""
    config = script.parent / "accelerate.yaml"
    config.write_text(ACCELERATE_SP + "  parallelism_config_sp_attn_implementation: sdpa\n")
    rows, _ = dry_run("--config", str(config))
    assert rows["parallelism.sp_size"] == ["2", f"--config {config}"]
    assert rows["parallelism.cp_size"] == ["2", f"--config {config}"]
    config.write_text(ACCELERATE_SP + "  parallelism_config_sp_attn_implementation: flash_attention_2\n")
    assert_one_line_error(cpctl("launch", "--dry-run", "--config", str(config), "train.py"),
                          f"{config}: parallelism_config.parallelism_config_sp_attn_implementation: flash_attention_2: "
                          "expected sdpa")


def test_dashes_and_equals_too(script: Path) -> None:
    rows, _ = dry_run("--cpu", "--num-processes=2", "--parallelism-config-cp-size=2", "--fsdp-offload-params", "false",
                      "--fsdp-activation-checkpointing", "true", "--fsdp_reshard_after_forward", "false",
                      "--max_restarts", "1")  # cpctl's own flag, in accelerate's spelling
    assert rows["launch.nproc_per_node"] == ["2", "flag --num-processes 2"]
    assert rows["fsdp.activation_checkpointing"] == ["true", "flag --fsdp-activation-checkpointing"]
    assert rows["fsdp.reshard_after_forward"] == ["false", "flag --fsdp-reshard-after-forward"]
    assert rows["memory.cpu_offload"] == ["false", "flag --fsdp-offload-params"]
    assert rows["launch.max_restarts"] == ["1", "flag --max-restarts"]


@pytest.mark.parametrize(("ip_port", "endpoint"), [
    (("--main-process-port", "29400"), ["127.0.0.1:29400", "flag --main-process-port"]),  # one machine: its MASTER_ADDR
    (("--main-process-port", "0"), ["null", "default"]),  # a free port: cpctl's standalone rendezvous picks one
    (("--main-process-ip", "node0"), ["node0:29500", "flag --main-process-ip"]),  # accelerate's default port
])
def test_the_main_process_address_is_the_rendezvous_endpoint(script: Path, ip_port: tuple[str, ...],
                                                              endpoint: list[str]) -> None:
    rows, _ = dry_run("--cpu", *ip_port)
    assert rows["launch.rdzv_endpoint"] == endpoint


@pytest.mark.parametrize(("args", "fragments"), [
    # cpctl's own rules, with the accelerate flag named as the source
    (("--num-processes", "2", "--parallelism-config-cp-size", "3"), ["cp(3) * tp(1) = 3 does not divide world size 2"]),
    (("--parallelism-config-cp-size", "two"), ["flag --parallelism-config-cp-size: 'two' is not allowed for "
                                               "parallelism.cp_size; expected an integer >= 1"]),
    (("--parallelism-config-cp-size", "2", "--fsdp-version", "1"), ["context parallelism needs fsdp.version: 2"]),
    (("--parallelism-config-cp-comm-strategy", "ring"), ["flag --parallelism-config-cp-comm-strategy: 'ring'"]),
    (("--mixed_precision", "fp8"), ["flag --mixed-precision: 'fp8' is not allowed for fsdp.mixed_precision"]),
    (("--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "h"), ["node_rank: 2 must be below nnodes (2)"]),
    # accelerate's meaning of the total
    (("--num-processes", "3", "--num-machines", "2", "--main-process-ip", "h"),
     ["--num-processes 3 is the total over 2 machines (accelerate's meaning), and 3 is not a multiple of 2"]),
    (("--num-processes", "0"), ["flag --num-processes: '0' is not allowed; expected an integer >= 1"]),
    (("--num-machines", "2", "--main-process-port", "29400"), ["--main-process-port without --main-process-ip across 2 machines"]),
    (("--num-machines", "2", "--main-process-ip", "h", "--main-process-port", "0"), ["a free port) works on one machine only"]),
    (("--main-process-port", "http"), ["flag --main-process-port: 'http' is not allowed; expected a port 0-65535"]),
    (("--parallelism-config-cp-backend", "deepspeed"), ["flag --parallelism-config-cp-backend: 'deepspeed' is not allowed; expected torch"]),
    # one key, two values
    (("--cp-size", "2", "--parallelism-config-cp-size", "4"),
     ["--cp-size 2 and --parallelism-config-cp-size 4 both set parallelism.cp_size; pass one of them"]),
    (("--nproc-per-node", "3", "--num-processes", "4"), ["--nproc-per-node 3 and --num-processes 4 both set launch.nproc_per_node"]),
    (("--cpu", "--multi-gpu"), ["--cpu and --multi-gpu both set launch.device"]),
], ids=lambda value: " ".join(value) if isinstance(value, tuple) else None)
def test_the_same_validation(script: Path, args: tuple[str, ...], fragments: list[str]) -> None:
    assert_one_line_error(cpctl("launch", "--dry-run", "--cpu", *args, "train.py"), *fragments)


def test_the_same_value_twice_is_fine(script: Path) -> None:
    rows, _ = dry_run("--cpu", "--cp-size", "2", "--parallelism-config-cp-size", "2", "--nproc-per-node", "2",
                      "--num-processes", "2")
    assert rows["parallelism.cp_size"] == ["2", "flag --cp-size"]


@pytest.mark.parametrize(("flag", "fragment"), [
    (["--config_file", "acc.yaml"], "cpctl reads the file accelerate config writes as --config FILE"),
    (["--use_deepspeed"], "not DeepSpeed"),
    (["--deepspeed_config_file", "ds.json"], "not DeepSpeed"),
    (["--zero_stage", "3"], "not DeepSpeed"),
    (["--fsdp_sharding_strategy", "FULL_SHARD"], "cpctl wraps every transformer block with FSDP2 itself"),
    (["--fsdp-auto-wrap-policy", "SIZE_BASED_WRAP"], "cpctl wraps every transformer block with FSDP2 itself"),
    (["--gpu_ids", "0,1"], "CUDA_VISIBLE_DEVICES"),
    (["--dynamo_backend", "inductor"], "torch.compile"),
    (["--megatron_lm_tp_degree", "2"], "Megatron-LM"),
    (["--num_cpu_threads_per_process", "4"], "OMP_NUM_THREADS"),
    (["--rdzv_backend", "static"], "cpctl chooses the rendezvous"),
    (["--tpu"], "NVIDIA GPUs and CPUs"),
], ids=lambda value: value[0] if isinstance(value, list) else None)
def test_what_cpctl_cannot_honour_is_one_line_each(script: Path, flag: list[str], fragment: str) -> None:
    line = assert_one_line_error(cpctl("launch", "--dry-run", *flag, "train.py"), fragment)
    assert line.startswith(f"error: {flag[0]}: accelerate launch's flag, which cpctl cannot honour: "), line


def test_the_tables_are_declared_once_and_do_not_overlap() -> None:
    honoured = {alias.name for alias in ALIASES}
    assert len(honoured) == len(ALIASES)
    assert not honoured & set(CANNOT_HONOUR)
    assert all(name.startswith("--") and "_" not in name for name in honoured | set(CANNOT_HONOUR))
