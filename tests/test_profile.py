"""Profile resolution and validation, in plain Python (milliseconds, no torch).

Every test passes `environ`, `cwd` and `machine` explicitly, so nothing here depends on the
box it runs on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cpctl import config as P
from cpctl.errors import CpctlError

CPU = P.Machine(cuda_devices=0)


def write(path: Path, tree: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree), encoding="utf-8")
    return path


def resolve_apart(tmp_path: Path, *, environ: dict | None = None, machine: P.Machine = CPU, **kwargs) -> P.Resolved:
    """`resolve` in `tmp_path`, apart from this host's variables, user profile and GPUs."""
    environ = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)} | (environ or {})
    return P.resolve(environ=environ, cwd=tmp_path, machine=machine, **kwargs)



def source_of(resolved: P.Resolved, path: str) -> str:
    return {key: source for key, _, source in resolved.rows()}[path]


def error_of(tmp_path: Path, **kwargs) -> str:
    with pytest.raises(CpctlError) as caught:
        resolve_apart(tmp_path, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- defaults and auto


def test_defaults_on_a_cpu_machine(tmp_path: Path) -> None:
    resolved = resolve_apart(tmp_path)
    profile = resolved.profile
    assert (profile.launch.device, profile.launch.nproc_per_node) == ("cpu", 2)
    assert profile.parallelism.dp_shard_size == 2  # auto: world 2 / (1 * 1 * 1)
    assert profile.fsdp.mixed_precision == "no"
    assert source_of(resolved, "parallelism.cp_size") == "default"
    assert resolved.sources["launch.device"].startswith("auto")
    assert resolved.sources["parallelism.dp_shard_size"] == "auto (world 2 / 1)"


def test_auto_on_a_gpu_machine(tmp_path: Path) -> None:
    profile = resolve_apart(tmp_path, machine=P.Machine(cuda_devices=8), flags={"parallelism.cp_size": "4"}).profile
    assert (profile.launch.device, profile.launch.nproc_per_node) == ("cuda", 8)
    assert profile.parallelism.dp_shard_size == 2
    assert profile.fsdp.mixed_precision == "bf16"


def test_dp_shard_auto_fills_the_world(tmp_path: Path) -> None:
    flags = {"launch.nproc_per_node": "8", "parallelism.cp_size": "2", "parallelism.tp_size": "2"}
    resolved = resolve_apart(tmp_path, flags=flags)
    assert resolved.profile.parallelism.dp_shard_size == 2
    assert resolved.sources["parallelism.dp_shard_size"] == "auto (world 8 / 4)"


def test_dp_shard_auto_that_cannot_divide(tmp_path: Path) -> None:
    message = error_of(tmp_path, flags={"launch.nproc_per_node": "8", "parallelism.cp_size": "3"})
    assert "world size 8" in message and "dp_replicate(1) * cp(3) * tp(1) = 3" in message


# ----------------------------------------------------------------------------- resolution order

# Every layer sets launch.max_restarts to its own number; the highest layer present must win
# and be named as the source.
LAYERS = ("user default", "./cpctl.yaml", "--config", "env", "flag")


def _layered(tmp_path: Path, top: str) -> tuple[dict, dict, str | None]:
    environ: dict[str, str] = {}
    flags: dict[str, str] = {}
    config = None
    for value, layer in enumerate(LAYERS[: LAYERS.index(top) + 1], start=1):
        tree = {"launch": {"max_restarts": value}}
        if layer == "user default":
            write(tmp_path / "xdg" / "cpctl" / "default.yaml", tree)
        elif layer == "./cpctl.yaml":
            write(tmp_path / "cpctl.yaml", tree)
        elif layer == "--config":
            config = str(write(tmp_path / "mine.yaml", tree))
        elif layer == "env":
            environ["CPCTL_MAX_RESTARTS"] = str(value)
        else:
            flags["launch.max_restarts"] = str(value)
    return environ, flags, config


@pytest.mark.parametrize("top", LAYERS)
def test_each_layer_beats_the_ones_below(tmp_path: Path, top: str) -> None:
    environ, flags, config = _layered(tmp_path, top)
    resolved = resolve_apart(tmp_path, environ=environ, flags=flags, config=config)
    assert resolved.profile.launch.max_restarts == LAYERS.index(top) + 1
    source = resolved.sources["launch.max_restarts"]
    expected = {
        "user default": f"user default {tmp_path / 'xdg' / 'cpctl' / 'default.yaml'}",
        "./cpctl.yaml": "./cpctl.yaml",
        "--config": f"--config {config}",
        "env": "env CPCTL_MAX_RESTARTS",
        "flag": "flag --max-restarts",
    }[top]
    assert source == expected


def test_layers_merge_key_by_key(tmp_path: Path) -> None:
    write(tmp_path / "xdg" / "cpctl" / "default.yaml", {"parallelism": {"cp_comm_strategy": "alltoall"}})
    write(tmp_path / "cpctl.yaml", {"fsdp": {"activation_checkpointing": True}})
    resolved = resolve_apart(tmp_path, environ={"CPCTL_CP_SIZE": "2"}, flags={"launch.max_restarts": "1"})
    profile, sources = resolved.profile, resolved.sources
    assert profile.parallelism.cp_comm_strategy == "alltoall" and sources["parallelism.cp_comm_strategy"].startswith("user default")
    assert profile.fsdp.activation_checkpointing is True and sources["fsdp.activation_checkpointing"] == "./cpctl.yaml"
    assert profile.parallelism.cp_size == 2 and sources["parallelism.cp_size"] == "env CPCTL_CP_SIZE"
    assert sources["launch.max_restarts"] == "flag --max-restarts"
    assert source_of(resolved, "parallelism.tp_size") == "default"


def test_profile_name_lookup_prefers_local_configs(tmp_path: Path) -> None:
    write(tmp_path / "xdg" / "cpctl" / "mine.yaml", {"launch": {"max_restarts": 1}})
    assert resolve_apart(tmp_path, profile_name="mine").profile.launch.max_restarts == 1
    write(tmp_path / "configs" / "mine.yaml", {"launch": {"max_restarts": 2}})
    resolved = resolve_apart(tmp_path, profile_name="mine")
    assert resolved.profile.launch.max_restarts == 2
    assert resolved.sources["launch.max_restarts"] == f"--profile mine ({tmp_path / 'configs' / 'mine.yaml'})"


def test_a_profile_the_wizard_wrote_here_is_found_by_name(tmp_path: Path) -> None:
    # `cpctl config -o mine.yaml` writes ./mine.yaml; `--profile mine` finds it (./configs/ first)
    write(tmp_path / "xdg" / "cpctl" / "mine.yaml", {"launch": {"max_restarts": 1}})
    write(tmp_path / "mine.yaml", {"launch": {"max_restarts": 3}})
    resolved = resolve_apart(tmp_path, profile_name="mine")
    assert resolved.sources["launch.max_restarts"] == f"--profile mine ({tmp_path / 'mine.yaml'})"
    assert resolve_apart(tmp_path, profile_name="mine.yaml").profile.launch.max_restarts == 3
    write(tmp_path / "configs" / "mine.yaml", {"launch": {"max_restarts": 2}})
    assert resolve_apart(tmp_path, profile_name="mine").profile.launch.max_restarts == 2
    write(tmp_path / "sub" / "other.yaml", {})
    assert "--profile takes a profile's name" in error_of(tmp_path, profile_name="sub/other")


def test_shipped_profiles_are_found_anywhere(tmp_path: Path) -> None:
    resolved = resolve_apart(tmp_path, profile_name="cpu-try")  # tmp_path has no configs/
    assert resolved.profile.parallelism.cp_size == 2
    assert resolved.files[0].parent == P.layers.installed_profiles_dir()


def test_config_and_profile_together(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {})
    assert "pass one of them" in error_of(tmp_path, config=str(tmp_path / "a.yaml"), profile_name="cpu-try")


# ----------------------------------------------------------------------------- bad input


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path / "p.yaml", {"parallelism": {"cp_sise": 2}})
    message = error_of(tmp_path, config=str(path))
    assert message == f"{path}: parallelism.cp_sise: unknown key; did you mean cp_size?"


def test_unknown_section_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path / "p.yaml", {"paralelism": {"cp_size": 2}})
    assert "paralelism: unknown key; did you mean parallelism?" in error_of(tmp_path, config=str(path))


def test_unknown_environment_variable(tmp_path: Path) -> None:
    message = error_of(tmp_path, environ={"CPCTL_CP_SISE": "2"})
    assert "CPCTL_CP_SISE: unknown variable; did you mean CPCTL_CP_SIZE?" in message


def test_unknown_profile_name(tmp_path: Path) -> None:
    assert "--profile cpu-tri: no such profile; did you mean cpu-try?" in error_of(tmp_path, profile_name="cpu-tri")


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        ({"parallelism": {"cp_size": "two"}}, "parallelism.cp_size: 'two' is not allowed; expected an integer >= 1"),
        ({"parallelism": {"cp_size": 0}}, "parallelism.cp_size: 0 is not allowed; expected an integer >= 1"),
        ({"parallelism": {"cp_load_balance": "maybe"}}, "parallelism.cp_load_balance: 'maybe' is not allowed; expected true or false"),
        ({"parallelism": {"cp_comm_strategy": "ring"}}, "parallelism.cp_comm_strategy: 'ring' is not allowed; expected allgather or alltoall"),
        ({"launch": {"rdzv_endpoint": "node0"}}, "launch.rdzv_endpoint: 'node0' is not allowed; expected host:port (port 1-65535) or null"),
        ({"version": 2}, "version: 2 is not allowed; expected 1"),
        ({"fsdp": 2}, "fsdp must be a mapping of keys"),
        ([1, 2], "a profile must be a YAML mapping"),
    ],
)
def test_wrong_type_or_range_in_a_file(tmp_path: Path, tree: object, expected: str) -> None:
    path = write(tmp_path / "p.yaml", yaml.safe_dump(tree))
    message = error_of(tmp_path, config=str(path))
    assert message.startswith(str(path)) and expected in message


def test_wrong_type_in_a_flag_and_a_variable(tmp_path: Path) -> None:
    assert "flag --cp-size: 'x' is not allowed for parallelism.cp_size" in error_of(tmp_path, flags={"parallelism.cp_size": "x"})
    assert "env CPCTL_NNODES: 'two' is not allowed for launch.nnodes" in error_of(tmp_path, environ={"CPCTL_NNODES": "two"})


def test_broken_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path / "p.yaml", "parallelism:\n  cp_size: [2\n")
    message = error_of(tmp_path, config=str(path))
    assert message.startswith(f"{path}: broken YAML (line ") and "cpctl config" in message


def test_missing_config_file(tmp_path: Path) -> None:
    assert "no such profile file" in error_of(tmp_path, config=str(tmp_path / "nope.yaml"))


def test_bare_no_is_the_string_no(tmp_path: Path) -> None:
    # YAML 1.1 reads `no` as false; the profile documents `mixed_precision: no`
    path = write(tmp_path / "p.yaml", "fsdp:\n  mixed_precision: no\n")
    assert resolve_apart(tmp_path, config=str(path)).profile.fsdp.mixed_precision == "no"


def test_sizes_that_do_not_multiply_to_the_world_propose_a_fix(tmp_path: Path) -> None:
    flags = {"launch.nproc_per_node": "8", "parallelism.cp_size": "2", "parallelism.dp_shard_size": "2"}
    message = error_of(tmp_path, flags=flags)
    assert "dp_replicate(1) * dp_shard(2) * cp(2) * tp(1) = 4 != world size 8" in message
    assert "(nnodes 1 x nproc_per_node 8)" in message
    assert "set dp_shard_size: 4 (or auto)" in message


def test_sizes_with_no_fitting_dp_shard(tmp_path: Path) -> None:
    flags = {"launch.nproc_per_node": "8", "parallelism.cp_size": "3", "parallelism.dp_shard_size": "1"}
    message = error_of(tmp_path, flags=flags)
    assert "= 3 != world size 8" in message and "change the sizes" in message


def test_cp_needs_fsdp2(tmp_path: Path) -> None:
    message = error_of(tmp_path, flags={"parallelism.cp_size": "2", "fsdp.version": "1"})
    assert message == "fsdp.version: 1 with cp_size 2; context parallelism needs fsdp.version: 2"
    assert resolve_apart(tmp_path, flags={"fsdp.version": "1"}).profile.fsdp.version == 1  # fine without CP


def test_the_retired_attention_key(tmp_path: Path) -> None:
    """`attention` did nothing but refuse values other than sdpa: a profile saying sdpa still reads,
    another value is one line that says to delete it, and no flag or variable sets it any more."""
    path = tmp_path / "old.yaml"
    path.write_text("parallelism:\n  cp_size: 2\nattention: sdpa\n")
    resolved = resolve_apart(tmp_path, config=str(path), flags={"launch.nproc_per_node": "2"})
    assert resolved.profile.parallelism.cp_size == 2 and not hasattr(resolved.profile, "attention")
    path.write_text("attention: eager\n")
    message = error_of(tmp_path, config=str(path))
    assert message == (f"{path}: attention: eager: a retired key; cpctl computes attention through SDPA at every cp "
                       "and sp size (a Hugging Face model needs attn_implementation='sdpa'); delete the line")
    assert "attention" not in P.KEYS
    assert resolve_apart(tmp_path, environ={"CPCTL_ATTENTION": "sdpa"}).profile.parallelism.cp_size == 1
    assert error_of(tmp_path, environ={"CPCTL_ATTENTION": "eager"}) == (
        "environment: CPCTL_ATTENTION=eager: a retired key; cpctl computes attention through SDPA at every cp and sp "
        "size (a Hugging Face model needs attn_implementation='sdpa'); unset it")


def test_too_few_gpus(tmp_path: Path) -> None:
    flags = {"launch.device": "cuda", "launch.nproc_per_node": "4"}
    message = error_of(tmp_path, flags=flags, machine=P.Machine(cuda_devices=2))
    assert "launch.nproc_per_node: 4 workers but 2 GPUs visible; use --nproc-per-node 2 or fewer" in message
    message = error_of(tmp_path, flags=flags, machine=CPU)
    assert "launch.device is cuda but no GPU is visible; use --device cpu" in message


def test_several_nodes_need_a_rendezvous(tmp_path: Path) -> None:
    assert "pass --rdzv-endpoint" in error_of(tmp_path, flags={"launch.nnodes": "2"})
    flags = {"launch.nnodes": "2", "launch.node_rank": "2", "launch.rdzv_endpoint": "h:1"}
    assert "node_rank: 2 must be below nnodes (2)" in error_of(tmp_path, flags=flags)


# ----------------------------------------------------------------------------- SLURM


SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[003-004,010],cpu1",
}


def test_slurm_variables_give_nodes_rank_and_endpoint(tmp_path: Path) -> None:
    resolved = resolve_apart(tmp_path, environ=SLURM)
    launch = resolved.profile.launch
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (2, 1, "gpu003:29500")
    assert {resolved.sources[f"launch.{key}"] for key in ("nnodes", "node_rank", "rdzv_endpoint")} == {"SLURM"}
    assert resolved.profile.world_size == 4


def test_flags_and_variables_beat_slurm(tmp_path: Path) -> None:
    environ = SLURM | {"CPCTL_RDZV_ENDPOINT": "head:1234"}
    resolved = resolve_apart(tmp_path, environ=environ, flags={"launch.node_rank": "0"})
    assert resolved.profile.launch.rdzv_endpoint == "head:1234"
    assert resolved.sources["launch.node_rank"] == "flag --node-rank"


def test_without_slurm_job_id_slurm_variables_are_ignored(tmp_path: Path) -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    assert resolve_apart(tmp_path, environ=environ).profile.launch.nnodes == 1


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node7", "node7"), ("gpu[003-010,012]", "gpu003"), ("gpu[12,14]", "gpu12"), ("a1,b2", "a1")],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert P.layers.first_slurm_host(nodelist) == host


# ----------------------------------------------------------------------------- what workers get


def test_the_profile_survives_the_trip_to_the_workers(tmp_path: Path) -> None:
    resolved = resolve_apart(tmp_path, flags={"parallelism.cp_size": "2", "parallelism.cp_comm_strategy": "alltoall"})
    sent = json.dumps(resolved.profile.to_dict())
    assert P.Profile.from_tree(json.loads(sent)) == resolved.profile


def test_merge_layers_keeps_auto(tmp_path: Path) -> None:
    values, sources, files = P.merge_layers(flags={"launch.device": "cuda"}, environ={}, cwd=tmp_path)
    assert values == {"launch.device": "cuda"} and sources == {"launch.device": "flag --device"} and files == ()


# ----------------------------------------------------------------------------- one declaration per key


def test_init_overrides_use_flag_names_and_refuse_ambiguous_ones() -> None:
    layer = P.layers.overrides_layer({"cp_size": 2, "fsdp_version": 1, "cp_load_balance": "false"})
    assert layer.values == {"parallelism.cp_size": 2, "fsdp.version": 1, "parallelism.cp_load_balance": False}
    assert layer.sources["fsdp.version"] == "cpctl.init(fsdp_version=...)"
    # `version` is the profile format's, never fsdp.version by its last name
    with pytest.raises(CpctlError, match=r"cpctl.init\(version=...\): unknown profile key; did you mean"):
        P.layers.overrides_layer({"version": 2})


def test_a_key_declared_once_reaches_flags_env_wizard_and_dry_run(tmp_path: Path) -> None:
    """Add one field to a copy of the schema: the CLI, the variables, the wizard and the dry run see it."""
    import shutil
    import subprocess
    import sys

    from launching import REPO, launch_env

    shutil.copytree(REPO / "cpctl", tmp_path / "cpctl", ignore=shutil.ignore_patterns("__pycache__"))
    schema = tmp_path / "cpctl" / "config" / "schema.py"
    anchor = "    activation_checkpointing: bool = key("
    added = ('    prefetch_blocks: int = key(integer(minimum=1), 4096, "blocks to prefetch", '
             'prompt="Blocks to prefetch")\n')
    assert anchor in schema.read_text()
    schema.write_text(schema.read_text().replace(anchor, added + anchor, 1))
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = launch_env(tmp_path) | {"PYTHONPATH": str(tmp_path)}

    def cpctl(*args: str, **extra_env: str) -> str:
        done = subprocess.run([sys.executable, "-m", "cpctl.launch.cli", *args], cwd=tmp_path, env=env | extra_env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def row(dry_run: str) -> list[str]:
        rows = [[cell.strip() for cell in line.split("│")] for line in dry_run.splitlines()]
        return next(cells for cells in rows if cells[0] == "fsdp.prefetch_blocks")

    assert "--prefetch-blocks" in cpctl("launch", "--help")
    dry_run = cpctl("launch", "--device", "cpu", "--prefetch-blocks", "8", "--dry-run", "train.py")
    assert row(dry_run) == ["fsdp.prefetch_blocks", "8", "flag --prefetch-blocks"]
    dry_run = cpctl("launch", "--device", "cpu", "--dry-run", "train.py", CPCTL_PREFETCH_BLOCKS="16")
    assert row(dry_run) == ["fsdp.prefetch_blocks", "16", "env CPCTL_PREFETCH_BLOCKS"]
    cpctl("config", "--yes", "--device", "cpu", "--prefetch-blocks", "32", "-o", "p.yaml")
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["fsdp"]["prefetch_blocks"] == 32
    cpctl("config", "--yes", "--device", "cpu", "-o", "q.yaml")  # the wizard asks it: its default is written
    assert yaml.safe_load((tmp_path / "q.yaml").read_text())["fsdp"]["prefetch_blocks"] == 4096


# ----------------------------------------------------------------------------- hostile and broken input


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize(("text", "expected"), [
    (ALIAS_BOMB, "YAML aliases (*name) are not allowed in a profile"),
    ("a: " + "[" * 2000 + "]" * 2000 + "\n", "nested deeper than 8 levels"),
    ("version: 1\n# " + "x" * (1 << 20) + "\n", "is not a profile (at most 65,536)"),
    ('parallelism:\n  cp_size: "' + "y" * 5000 + '"\n', "parallelism.cp_size: 'yyyyy"),
])
def test_hostile_profiles_are_refused_in_one_short_line(tmp_path: Path, text: str, expected: str) -> None:
    # Each is refused by what it is (aliases, depth, size) before anything expands it.
    path = write(tmp_path / "p.yaml", text)
    message = error_of(tmp_path, config=str(path))
    assert expected in message and len(message) < 400


def test_the_workers_profile_variable_is_checked() -> None:
    import json

    with pytest.raises(CpctlError, match="CPCTL_RESOLVED_PROFILE is not the JSON `cpctl launch` writes"):
        P.for_worker({}, environ={P.PROFILE_ENV_VAR: "{broken", "WORLD_SIZE": "2"}, cuda_devices=0)
    one = P.resolve(flags={"launch.nproc_per_node": "1", "launch.device": "cpu"}, environ={}, cwd="/")
    environ = {P.PROFILE_ENV_VAR: json.dumps(one.profile.to_dict()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(CpctlError, match="the profile is for 1 processes but this job has WORLD_SIZE 2"):
        P.for_worker({}, environ=environ, cuda_devices=0)


@pytest.mark.parametrize("key", ["memory.offload_activations", "memory.cpu_offload"])
def test_gpu_memory_offload_on_cpu_is_one_clear_error(tmp_path: Path, key: str) -> None:
    message = error_of(tmp_path, flags={key: "true", "launch.device": "cpu"})
    assert f"{key}: true on device cpu" in message and "set it to false" in message
    resolve_apart(tmp_path, flags={key: "true", "launch.device": "cuda", "launch.nproc_per_node": "1",
                                   "fsdp.activation_checkpointing": "true"},
                  machine=P.Machine(cuda_devices=1))  # fine where there are GPUs


def test_activation_offload_needs_checkpointing(tmp_path: Path) -> None:
    flags = {"memory.offload_activations": "true", "launch.device": "cuda", "launch.nproc_per_node": "1"}
    message = error_of(tmp_path, flags=flags, machine=P.Machine(cuda_devices=1))
    assert "without fsdp.activation_checkpointing would pin every activation" in message


def test_selective_level_needs_checkpointing(tmp_path: Path) -> None:
    message = error_of(tmp_path, flags={"memory.checkpoint_level": "selective", "launch.device": "cpu"})
    assert "memory.checkpoint_level: selective without fsdp.activation_checkpointing" in message
    assert "set activation_checkpointing: true" in message
    resolve_apart(tmp_path, flags={"memory.checkpoint_level": "selective", "launch.device": "cpu",
                                   "fsdp.activation_checkpointing": "true"})
    bad = error_of(tmp_path, flags={"memory.checkpoint_level": "some", "launch.device": "cpu"})
    assert "'some' is not allowed for memory.checkpoint_level; expected full, selective, mixed" in bad


class _Reads(dict):
    """A flat profile that records which key paths a rule looks at."""

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, path: str):
        self.read.add(path)
        return super().__getitem__(path)

    def get(self, path: str, default=None):
        self.read.add(path)
        return super().get(path, default)

    def __contains__(self, path: object) -> bool:
        self.read.add(str(path))
        return super().__contains__(path)


@pytest.mark.parametrize("layout", [
    {},
    {"parallelism": {"cp_size": 2}, "launch": {"device": "cpu", "nproc_per_node": 2}},
    {"parallelism": {"cp_size": 4, "dp_shard_size": 2}, "launch": {"device": "cuda", "nproc_per_node": 8},
     "fsdp": {"activation_checkpointing": True}, "memory": {"offload_activations": True}},
    {"launch": {"script_api": "accelerate", "device": "cpu", "nproc_per_node": 2}, "parallelism": {"cp_size": 2}},
])
def test_each_rule_reads_only_the_keys_it_declares(layout: dict) -> None:
    from cpctl.config.rules import RULES, Machine, fill_auto
    from cpctl.config.schema import flatten

    values, _ = fill_auto(P.DEFAULTS | flatten(layout), machine=Machine(cuda_devices=8))
    for rule in RULES:
        seen = _Reads(values)
        rule.problem(seen, Machine(cuda_devices=8))
        undeclared = seen.read - set(rule.keys) - set(rule.also_reads)
        assert not undeclared, f"{rule.problem.__name__} reads {sorted(undeclared)} without declaring them"


def test_a_count_of_selective_blocks_is_the_mixed_levels(tmp_path: Path) -> None:
    on = {"launch.device": "cpu", "fsdp.activation_checkpointing": "true"}
    message = error_of(tmp_path, flags={**on, "memory.selective_blocks": "3"})
    assert "memory.selective_blocks: 3 with checkpoint_level: full" in message and "set checkpoint_level: mixed" in message
    for count, value in (("3", 3), ("fit", "fit"), ("0", 0)):
        resolved = resolve_apart(tmp_path, flags={**on, "memory.checkpoint_level": "mixed", "memory.selective_blocks": count})
        assert resolved.profile.memory.selective_blocks == value
    bad = error_of(tmp_path, flags={**on, "memory.checkpoint_level": "mixed", "memory.selective_blocks": "-1"})
    assert "expected an integer >= 0 or fit" in bad


@pytest.mark.parametrize(("visible", "installed", "count"), [
    ("0,1", None, 2), ("", None, 0), ("-1", None, 0), ("NoDevFiles", None, 0), ("garbage,0,1", None, 0),
    ("0,garbage,1", None, 1), (" 0, 1 ", None, 2), ("GPU-8f6c1c2a-aaaa,MIG-1b2c", None, 2), ("0,1,2,3", 2, 2),
])
def test_cuda_visible_devices_counts_as_cuda_reads_it(visible: str, installed: int | None, count: int) -> None:
    """Up to the first entry that names no GPU: `garbage` is no GPU, not one (the dry run then shows
    what a real launch gets)."""
    from cpctl.config.rules import cuda_visible_count

    assert cuda_visible_count(visible, installed=installed) == count
