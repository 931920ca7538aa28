"""The cpctl profile: schema, loading, validation and layered resolution with sources.

A profile is a nested YAML mapping (SPEC section 1). Each layer (built-in defaults, the user
default profile, ./cpctl.yaml, --config/--profile, CPCTL_* environment variables, SLURM,
launch flags) is validated on its own so that an error names the file or flag it came from;
the layers are then overlaid, highest priority last, and the value of every key keeps the
name of the layer it came from. `auto` values are resolved against the machine at the end.

This module never imports torch: `cpctl launch --dry-run` and `cpctl check` stay fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cpctl.errors import CpctlError

PROFILE_VERSION = 1
AUTO = "auto"
STRATEGIES = ("allgather", "alltoall")
PRECISIONS = ("bf16", "fp16", "no")
DEVICES = ("auto", "cuda", "cpu")
CPU_DEFAULT_NPROC = 2
DEFAULT_RDZV_PORT = 29500

# The environment variable that carries the resolved profile from `cpctl launch` to workers.
PROFILE_ENV_VAR = "CPCTL_RESOLVED_PROFILE"
USER_PROFILE_NAME = "default.yaml"
LOCAL_PROFILE = "cpctl.yaml"


# ----------------------------------------------------------------------------- typed model


@dataclass(frozen=True)
class Parallelism:
    dp_replicate_size: int = 1
    dp_shard_size: int | str = AUTO
    cp_size: int = 1
    tp_size: int = 1
    cp_comm_strategy: str = "allgather"
    cp_load_balance: bool = True


@dataclass(frozen=True)
class Fsdp:
    version: int = 2
    reshard_after_forward: bool = True
    mixed_precision: str = AUTO  # resolved: bf16 on cuda, no on cpu
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class Launch:
    device: str = AUTO
    nnodes: int = 1
    nproc_per_node: int | str = AUTO
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0


@dataclass(frozen=True)
class Profile:
    version: int = PROFILE_VERSION
    parallelism: Parallelism = field(default_factory=Parallelism)
    fsdp: Fsdp = field(default_factory=Fsdp)
    attention: str = "sdpa"
    launch: Launch = field(default_factory=Launch)

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node  # type: ignore[operator]

    def get(self, path: str) -> Any:
        section, _, key = path.rpartition(".")
        owner = getattr(self, section) if section else self
        return getattr(owner, key)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class FieldSpec:
    """One profile key: how to parse it from text, how to check it, what it means."""

    path: str
    parse_text: Callable[[str], Any]
    check: Callable[[Any], bool]
    allowed: str
    help: str

    @property
    def leaf(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def flag(self) -> str:
        return "--" + self.env_suffix.lower().replace("_", "-")

    @property
    def env_suffix(self) -> str:
        return "FSDP_VERSION" if self.path == "fsdp.version" else self.leaf.upper()

    @property
    def env_var(self) -> str:
        return "CPCTL_" + self.env_suffix


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _non_negative(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _positive_or_auto(value: Any) -> bool:
    return value == AUTO or _positive(value)


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: not isinstance(value, bool) and value in choices


def _endpoint(value: Any) -> bool:
    if value is None:
        return True
    match = isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})", value)
    return bool(match) and 1 <= int(match.group(1)) <= 65535


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _parse_int_or_auto(text: str) -> int | str:
    return AUTO if text.strip().lower() == AUTO else int(text)


def _parse_int(text: str) -> int:
    return int(text)


def _parse_str(text: str) -> str:
    return text.strip()


def _parse_endpoint(text: str) -> str | None:
    return None if text.strip().lower() in ("", "null", "none") else text.strip()


FIELDS: dict[str, FieldSpec] = {
    spec.path: spec
    for spec in (
        FieldSpec("version", _parse_int, _one_of(PROFILE_VERSION), "1", "profile format version"),
        FieldSpec("parallelism.dp_replicate_size", _parse_int, _positive, "an integer >= 1",
                  "HSDP replicas (full copies of the sharded model)"),
        FieldSpec("parallelism.dp_shard_size", _parse_int_or_auto, _positive_or_auto,
                  "an integer >= 1 or auto", "FSDP shards; auto = world / (dp_replicate * cp * tp)"),
        FieldSpec("parallelism.cp_size", _parse_int, _positive, "an integer >= 1",
                  "ranks that split each sequence (context parallelism)"),
        FieldSpec("parallelism.tp_size", _parse_int, _positive, "an integer >= 1",
                  "tensor-parallel ranks"),
        FieldSpec("parallelism.cp_comm_strategy", _parse_str, _one_of(*STRATEGIES),
                  " or ".join(STRATEGIES), "how K/V move between CP ranks"),
        FieldSpec("parallelism.cp_load_balance", _parse_bool, lambda v: isinstance(v, bool),
                  "true or false", "head-tail sharding so causal work is even per rank"),
        FieldSpec("fsdp.version", _parse_int, _one_of(1, 2), "1 or 2", "FSDP version (CP needs 2)"),
        FieldSpec("fsdp.reshard_after_forward", _parse_bool, lambda v: isinstance(v, bool),
                  "true or false", "free gathered parameters after forward"),
        FieldSpec("fsdp.mixed_precision", _parse_str, _one_of(AUTO, *PRECISIONS),
                  "auto, " + ", ".join(PRECISIONS), "parameter dtype for compute"),
        FieldSpec("fsdp.activation_checkpointing", _parse_bool, lambda v: isinstance(v, bool),
                  "true or false", "recompute block activations in backward"),
        FieldSpec("attention", _parse_str, _one_of("sdpa", "eager", "flash_attention_2"),
                  "sdpa (eager, flash_attention_2 without CP)", "attention implementation"),
        FieldSpec("launch.device", _parse_str, _one_of(*DEVICES), ", ".join(DEVICES),
                  "cuda, cpu, or auto (cuda if a GPU is visible)"),
        FieldSpec("launch.nnodes", _parse_int, _positive, "an integer >= 1", "machines"),
        FieldSpec("launch.nproc_per_node", _parse_int_or_auto, _positive_or_auto,
                  "an integer >= 1 or auto", "worker processes per machine"),
        FieldSpec("launch.node_rank", _parse_int, _non_negative, "an integer >= 0",
                  "this machine's index among nnodes"),
        FieldSpec("launch.rdzv_endpoint", _parse_endpoint, _endpoint, "host:port (port 1-65535) or null",
                  "rendezvous address for several machines"),
        FieldSpec("launch.max_restarts", _parse_int, _non_negative, "an integer >= 0",
                  "times the elastic agent restarts failed workers"),
    )
}

SECTIONS = ("parallelism", "fsdp", "launch")


# ----------------------------------------------------------------------------- layers


def _suggest(name: str, known: Iterable[str], *, kind: str = "keys") -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f"; known {kind}: {', '.join(sorted(known))}"


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key in SECTIONS and not prefix and isinstance(value, Mapping):
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        section, _, key = path.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[key] = value
    return tree


def _check_layer(tree: Any, source: str) -> dict[str, Any]:
    """Validate one layer's keys and values; return it unchanged. Errors name `source`."""
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise CpctlError(f"{source}: a profile must be a YAML mapping of keys, got {type(tree).__name__}")
    for key, value in tree.items():
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise CpctlError(f"{source}: {key} must be a mapping of keys, got {value!r}")
            known = [spec.leaf for spec in FIELDS.values() if spec.path.startswith(f"{key}.")]
            for sub in value:
                if sub not in known:
                    raise CpctlError(f"{source}: {key}.{sub}: unknown key{_suggest(str(sub), known)}")
        elif key not in FIELDS:
            raise CpctlError(f"{source}: {key}: unknown key{_suggest(str(key), list(FIELDS) + list(SECTIONS))}")
    for path, value in _flatten({k: v for k, v in tree.items() if v is not None or k not in SECTIONS}).items():
        spec = FIELDS[path]
        if not spec.check(value):
            raise CpctlError(f"{source}: {path}: {value!r} is not allowed; expected {spec.allowed}")
    return dict(tree)


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice: YAML keeps the last one, silently."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read and validate one YAML profile file as a layer."""
    path = Path(path)
    if not path.exists():
        raise CpctlError(f"{path}: no such profile file; check the path or run `cpctl config --output {path}`")
    if not path.is_file():
        raise CpctlError(f"{path}: not a regular file; pass the path of a YAML profile")
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except (OSError, UnicodeDecodeError) as exc:
        raise CpctlError(f"{path}: cannot read the profile ({exc.__class__.__name__}: {exc}); "
                         "it must be a readable UTF-8 YAML file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise CpctlError(f"{path}: broken YAML{where}: {problem}; fix the file or regenerate it with `cpctl config`") from None
    return _check_layer(_unquoted_no(tree), str(path))


def _unquoted_no(tree: Any) -> Any:
    """YAML 1.1 reads a bare `no` as false; `mixed_precision: no` means the string "no"."""
    fsdp = tree.get("fsdp") if isinstance(tree, Mapping) else None
    if isinstance(fsdp, Mapping) and fsdp.get("mixed_precision") is False:
        return {**tree, "fsdp": {**fsdp, "mixed_precision": "no"}}
    return tree


def text_layer(values: Mapping[str, str], *, source_of: Callable[[FieldSpec], str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse key-path -> text values (env vars, flags) into a validated layer and its sources."""
    flat: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path, text in values.items():
        spec = FIELDS[path]
        try:
            value = spec.parse_text(text) if isinstance(text, str) else text
        except ValueError:
            raise CpctlError(f"{source_of(spec)}: {text!r} is not allowed for {path}; expected {spec.allowed}") from None
        if not spec.check(value):
            raise CpctlError(f"{source_of(spec)}: {value!r} is not allowed for {path}; expected {spec.allowed}")
        flat[path] = value
        sources[path] = source_of(spec)
    return _unflatten(flat), sources


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The CPCTL_<KEY> environment variables as a layer."""
    by_var = {spec.env_var: spec.path for spec in FIELDS.values() if spec.path != "version"}
    unknown = [name for name in environ if name.startswith("CPCTL_") and name not in by_var
               and name not in _RESERVED_ENV]
    if unknown:
        raise CpctlError(f"environment: {unknown[0]}: unknown variable{_suggest(unknown[0], by_var, kind='variables')}")
    values = {by_var[name]: text for name, text in environ.items() if name in by_var}
    return text_layer(values, source_of=lambda spec: f"env {spec.env_var}")


_RESERVED_ENV = {PROFILE_ENV_VAR}


def slurm_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """nnodes, node_rank and the rendezvous host from SLURM's variables, when under SLURM."""
    if "SLURM_JOB_ID" not in environ:
        return {}, {}
    values: dict[str, str] = {}
    nnodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if nnodes:
        values["launch.nnodes"] = nnodes
    if "SLURM_NODEID" in environ:
        values["launch.node_rank"] = environ["SLURM_NODEID"]
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist and nnodes and nnodes.strip().isdigit() and int(nnodes) > 1:
        values["launch.rdzv_endpoint"] = f"{first_slurm_host(nodelist)}:{DEFAULT_RDZV_PORT}"
    return text_layer(values, source_of=lambda spec: "SLURM")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist: `gpu[003-010,012],cpu1` -> `gpu003`."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise CpctlError(f"SLURM: cannot read the node list {nodelist!r}; pass --rdzv-endpoint HOST:PORT")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def user_config_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "cpctl"


def installed_profiles_dir() -> Path:
    """Profiles shipped inside the package (a copy of the repo's configs/)."""
    return Path(__file__).resolve().parent / "profiles"


def find_profile(name: str, *, cwd: Path, environ: Mapping[str, str]) -> Path:
    """--profile NAME: ./configs/, then the user config dir, then the profiles installed with cpctl."""
    filename = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    places = [cwd / "configs", user_config_dir(environ), installed_profiles_dir()]
    for place in places:
        if (place / filename).is_file():
            return place / filename
    known = sorted({p.stem for place in places if place.is_dir() for p in place.glob("*.yaml")})
    raise CpctlError(f"--profile {name}: no such profile{_suggest(name, known, kind='profiles')}")


# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Machine:
    """What `auto` values resolve against. Filled without importing torch."""

    cuda_devices: int


@dataclass(frozen=True)
class Resolved:
    """A validated profile with every `auto` filled in and the source of every value."""

    profile: Profile
    sources: dict[str, str]
    files: tuple[Path, ...] = ()

    def rows(self) -> list[tuple[str, Any, str]]:
        return [(path, self.profile.get(path), self.sources.get(path, "default")) for path in FIELDS]


def resolve(
    *,
    flags: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
    profile_name: str | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    machine: Machine | None = None,
) -> Resolved:
    """Resolve a profile: flags > CPCTL_* env > SLURM > --config/--profile > ./cpctl.yaml
    > user default > built-in defaults; then fill `auto` and check the whole."""
    environ = os.environ if environ is None else environ
    merged, sources, files = merge_layers(flags=flags, config=config, profile_name=profile_name,
                                          environ=environ, cwd=cwd)
    machine = machine if machine is not None else detect_machine(environ)
    profile, auto_sources = fill_auto(_build(_unflatten(merged)), machine=machine)
    sources.update(auto_sources)
    validate(profile, machine=machine)
    return Resolved(profile=profile, sources=sources, files=files)


def merge_layers(
    *,
    flags: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
    profile_name: str | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[dict[str, Any], dict[str, str], tuple[Path, ...]]:
    """The layers overlaid, before `auto` is filled: (key path -> value, key path -> source, files).

    `resolve` is this plus the machine; `cpctl check --static` reads what a profile asks of
    its machine from here (a cuda profile's nproc_per_node) to validate it away from that machine.
    """
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if config is not None and profile_name is not None:
        raise CpctlError("--config and --profile both given; pass one of them")

    layers: list[tuple[dict[str, Any], dict[str, str]]] = []  # lowest priority first
    files: list[Path] = []

    def add_file(path: Path, label: str) -> None:
        tree = load_file(path)
        layers.append((tree, {p: label for p in _flatten(tree)}))
        files.append(path)

    user_default = user_config_dir(environ) / USER_PROFILE_NAME
    if user_default.is_file():
        add_file(user_default, f"user default {user_default}")
    if (cwd / LOCAL_PROFILE).is_file():
        add_file(cwd / LOCAL_PROFILE, f"./{LOCAL_PROFILE}")
    if config is not None:
        add_file(cwd / Path(config).expanduser(), f"--config {config}")  # an absolute path stays as is
    if profile_name is not None:
        found = find_profile(profile_name, cwd=cwd, environ=environ)
        add_file(found, f"--profile {profile_name} ({found})")
    layers.append(slurm_layer(environ))
    layers.append(env_layer(environ))
    if flags:
        given = {path: value for path, value in flags.items() if value is not None}
        layers.append(text_layer(given, source_of=lambda spec: f"flag {spec.flag}"))

    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for tree, layer_sources in layers:
        flat = {p: v for p, v in _flatten(tree).items() if p in FIELDS}
        merged.update(flat)
        sources.update({p: layer_sources.get(p, "?") for p in flat})
    return merged, sources, tuple(files)


def _build(tree: Mapping[str, Any]) -> Profile:
    return Profile(
        version=tree.get("version", PROFILE_VERSION),
        parallelism=Parallelism(**(tree.get("parallelism") or {})),
        fsdp=Fsdp(**(tree.get("fsdp") or {})),
        attention=tree.get("attention", "sdpa"),
        launch=Launch(**(tree.get("launch") or {})),
    )


def from_dict(tree: Mapping[str, Any], *, source: str = "profile") -> Profile:
    """A Profile from a (validated) nested mapping, e.g. the one a launcher passed on."""
    return _build(_check_layer(tree, source))


def fill_auto(profile: Profile, *, machine: Machine) -> tuple[Profile, dict[str, str]]:
    """Every `auto` value resolved against `machine`; returns the profile and why each was chosen."""
    filled: dict[str, Any] = {}
    why: dict[str, str] = {}
    launch, par = profile.launch, profile.parallelism
    device = launch.device
    if device == AUTO:
        device = "cuda" if machine.cuda_devices > 0 else "cpu"
        filled["launch.device"] = device
        why["launch.device"] = f"auto ({machine.cuda_devices} GPUs visible)"
    nproc = launch.nproc_per_node
    if nproc == AUTO:
        nproc = machine.cuda_devices if device == "cuda" else CPU_DEFAULT_NPROC
        filled["launch.nproc_per_node"] = nproc
        why["launch.nproc_per_node"] = "auto (visible GPUs)" if device == "cuda" else "auto (2 on cpu)"
        if nproc < 1:
            raise CpctlError("launch.device is cuda but no GPU is visible; use --device cpu or check CUDA_VISIBLE_DEVICES")
    world = launch.nnodes * nproc
    if par.dp_shard_size == AUTO:
        others = par.dp_replicate_size * par.cp_size * par.tp_size
        if world % others:
            raise CpctlError(
                f"dp_shard_size auto: world size {world} (nnodes {launch.nnodes} x nproc_per_node {nproc}) "
                f"is not divisible by dp_replicate({par.dp_replicate_size}) * cp({par.cp_size}) * tp({par.tp_size}) "
                f"= {others}; change cp_size/tp_size/dp_replicate_size or --nproc-per-node"
            )
        filled["parallelism.dp_shard_size"] = world // others
        why["parallelism.dp_shard_size"] = f"auto (world {world} / {others})"
    if profile.fsdp.mixed_precision == AUTO:
        filled["fsdp.mixed_precision"] = "bf16" if device == "cuda" else "no"
        why["fsdp.mixed_precision"] = f"auto ({device})"
    if not filled:
        return profile, {}
    merged = {p: profile.get(p) for p in FIELDS} | filled
    return _build(_unflatten(merged)), why


def validate(profile: Profile, *, machine: Machine | None = None) -> None:
    """Cross-key rules of a resolved profile (no `auto` left)."""
    par, launch = profile.parallelism, profile.launch
    world = profile.world_size
    product = par.dp_replicate_size * par.dp_shard_size * par.cp_size * par.tp_size  # type: ignore[operator]
    if product != world:
        others = par.dp_replicate_size * par.cp_size * par.tp_size
        fix = (f"set dp_shard_size: {world // others} (or auto)" if world % others == 0
               else "change the sizes or --nproc-per-node/--nnodes so that they multiply to the world size")
        raise CpctlError(
            f"dp_replicate({par.dp_replicate_size}) * dp_shard({par.dp_shard_size}) * cp({par.cp_size}) * "
            f"tp({par.tp_size}) = {product} != world size {world} "
            f"(nnodes {launch.nnodes} x nproc_per_node {launch.nproc_per_node}); {fix}"
        )
    if par.cp_size > 1 and profile.fsdp.version != 2:
        raise CpctlError(f"fsdp.version: {profile.fsdp.version} with cp_size {par.cp_size}; context parallelism needs fsdp.version: 2")
    if par.cp_size > 1 and profile.attention != "sdpa":
        raise CpctlError(f"attention: {profile.attention} with cp_size {par.cp_size}; context parallelism needs attention: sdpa")
    if launch.node_rank >= launch.nnodes:
        raise CpctlError(f"launch.node_rank: {launch.node_rank} must be below nnodes ({launch.nnodes})")
    if launch.nnodes > 1 and launch.rdzv_endpoint is None:
        raise CpctlError(f"launch.nnodes: {launch.nnodes} machines need a rendezvous; pass --rdzv-endpoint HOST:PORT (the node-rank-0 host)")
    if machine is not None and launch.device == "cuda" and machine.cuda_devices == 0:
        raise CpctlError("launch.device is cuda but no GPU is visible; use --device cpu or check CUDA_VISIBLE_DEVICES")
    if machine is not None and launch.device == "cuda" and launch.nproc_per_node > machine.cuda_devices:  # type: ignore[operator]
        raise CpctlError(
            f"launch.nproc_per_node: {launch.nproc_per_node} workers but {machine.cuda_devices} GPUs visible; "
            f"use --nproc-per-node {machine.cuda_devices} or fewer (or --device cpu)"
        )


# ----------------------------------------------------------------------------- machine


def detect_machine(environ: Mapping[str, str] | None = None) -> Machine:
    """Count visible NVIDIA GPUs without importing torch (CUDA_VISIBLE_DEVICES, then the driver)."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part for part in visible.split(",") if part.strip() and part.strip() != "-1"]
        return Machine(cuda_devices=len(ids))
    gpus = Path("/proc/driver/nvidia/gpus")
    return Machine(cuda_devices=len(list(gpus.iterdir())) if gpus.is_dir() else 0)


def to_yaml(profile: Profile | Mapping[str, Any]) -> str:
    tree = profile.to_dict() if isinstance(profile, Profile) else dict(profile)
    return yaml.safe_dump(tree, sort_keys=False)
