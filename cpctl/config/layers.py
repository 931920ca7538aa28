"""Where profile values come from: files, CPCTL_* variables, SLURM, flags, torchrun, cpctl.init().

Each source becomes a `Layer`: flat key path -> value, validated on its own so that an error
names the file, variable or flag it came from, and the name of that source for every value
(`cpctl launch --dry-run` shows it). `resolve` overlays them.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cpctl.config.schema import BY_NAME, KEYS, RETIRED, SECTIONS, Flat, Key, flatten, shown
from cpctl.errors import CpctlError

# The environment variable that carries the resolved profile from `cpctl launch` to workers.
PROFILE_ENV_VAR = "CPCTL_RESOLVED_PROFILE"
USER_PROFILE_NAME = "default.yaml"
LOCAL_PROFILE = "cpctl.yaml"
DEFAULT_RDZV_PORT = 29500


@dataclass(frozen=True)
class Layer:
    values: Flat = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # key path -> where the value came from

    @classmethod
    def of(cls, values: Flat, source: str) -> Layer:
        return cls(dict(values), {path: source for path in values})


class MachineSource(str):
    """The name of a source that speaks for this machine alone (a flag, a CPCTL_ variable, SLURM,
    the machine_rank of accelerate's config file, which accelerate writes per machine), unlike a
    profile that every machine of a job shares. Only such a node rank picks the rendezvous host."""


def suggest(name: str, known: Iterable[str], *, kind: str = "keys") -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f"; known {kind}: {', '.join(sorted(known))}"


# ----------------------------------------------------------------------------- files


def tree_layer(tree: Any, source: str) -> Layer:
    """A nested profile mapping (a YAML file, the launcher's JSON) checked key by key."""
    if tree is None:
        return Layer()
    if not isinstance(tree, Mapping):
        raise CpctlError(f"{source}: a profile must be a YAML mapping of keys, got {type(tree).__name__}")
    for name, value in tree.items():
        if name in SECTIONS:
            if value is not None and not isinstance(value, Mapping):
                raise CpctlError(f"{source}: {name} must be a mapping of keys, got {shown(value)}")
            known = [k.leaf for k in KEYS.values() if k.path.startswith(f"{name}.")]
            for sub in value or {}:
                if sub not in known:
                    raise CpctlError(f"{source}: {name}.{shown(sub)[1:-1]}: unknown key{suggest(str(sub)[:40], known)}")
        elif name in RETIRED:
            if value != RETIRED[name].accepted:
                raise CpctlError(f"{source}: {name}: {value}: a retired key; {RETIRED[name].reason}; delete the line")
        elif name not in KEYS:
            raise CpctlError(f"{source}: {shown(name)[1:-1]}: unknown key{suggest(str(name)[:40], list(KEYS) + list(SECTIONS))}")
    values = flatten({name: value for name, value in tree.items()
                      if not (name in SECTIONS and value is None) and name not in RETIRED})
    for path, value in values.items():
        if not KEYS[path].check(value):
            raise CpctlError(f"{source}: {path}: {shown(value)} is not allowed; expected {KEYS[path].allowed}")
    return Layer.of(values, source)


# A profile is a few dozen lines: anything far larger, deeper or using YAML aliases is a
# mistake or an attack (an alias bomb expands 349 bytes into gigabytes), refused before parsing.
MAX_PROFILE_BYTES = 64 * 1024
MAX_PROFILE_DEPTH = 8


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice (YAML keeps the last one, silently), aliases and deep nesting."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(None, None, "YAML aliases (*name) are not allowed in a profile", mark)
        depth = getattr(self, "_depth", 0)
        if depth > MAX_PROFILE_DEPTH:
            raise yaml.constructor.ConstructorError(
                None, None, f"nested deeper than {MAX_PROFILE_DEPTH} levels", self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            name = self.construct_object(key_node, deep=deep)
            if name in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {name!r} given twice; keep one", key_node.start_mark)
            seen.add(name)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """A profile file's YAML, with errors that name the file, the line and the fix."""
    path = Path(path)
    if not path.exists():
        raise CpctlError(f"{path}: no such profile file; check the path or run `cpctl config --output {path}`")
    if not path.is_file():
        raise CpctlError(f"{path}: not a regular file; pass the path of a YAML profile")
    size = path.stat().st_size
    if size > MAX_PROFILE_BYTES:
        raise CpctlError(f"{path}: {size:,} bytes is not a profile (at most {MAX_PROFILE_BYTES:,}); "
                         "check the path or regenerate it with `cpctl config`")
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
    return _unquoted_no(tree)


def file_layer(path: str | Path, label: str | None = None) -> Layer:
    """A profile file; its errors name the file, its values' sources say `label` (`--config x.yaml`).
    A file `accelerate config` wrote is read as the profile it describes (config/accelerate_file.py)."""
    from cpctl.config import accelerate_file
    from cpctl.config.schema import to_tree

    tree = read_yaml(path)
    if not accelerate_file.is_accelerate_config(tree):
        layer = tree_layer(tree, str(path))
        return Layer.of(layer.values, label) if label else layer
    layer = tree_layer(to_tree(accelerate_file.values(tree, source=str(path))), str(path))
    sources = {key: label or str(path) for key in layer.values}
    if "launch.node_rank" in sources:  # its machine_rank: this machine's own
        sources["launch.node_rank"] = MachineSource(sources["launch.node_rank"])
    return Layer(layer.values, sources)


def _unquoted_no(tree: Any) -> Any:
    """YAML 1.1 reads a bare `no` as false; `mixed_precision: no` means the string "no"."""
    fsdp = tree.get("fsdp") if isinstance(tree, Mapping) else None
    if isinstance(fsdp, Mapping) and fsdp.get("mixed_precision") is False:
        return {**tree, "fsdp": {**fsdp, "mixed_precision": "no"}}
    return tree


def to_yaml(tree: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(tree), sort_keys=False)


def user_config_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "cpctl"


def installed_profiles_dir() -> Path:
    """Profiles shipped inside the package (a copy of the repo's configs/)."""
    return Path(__file__).resolve().parent.parent / "profiles"


def find_profile(name: str, *, cwd: Path, environ: Mapping[str, str]) -> Path:
    """--profile NAME: ./configs/, then the working directory (where `cpctl config -o NAME.yaml`
    writes), then the user config dir, then the profiles installed with cpctl."""
    filename = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    places = [cwd / "configs", cwd, user_config_dir(environ), installed_profiles_dir()]
    if "/" not in name:
        for place in places:
            if (place / filename).is_file():
                return place / filename
    if "/" in name or (cwd / name).is_file():  # a path: that is what --config takes
        raise CpctlError(f"--profile {name}: --profile takes a profile's name (e.g. cpu-try); "
                         f"for a file, use --config {name}")
    known = sorted({p.stem for place in places if place.is_dir() for p in place.glob("*.yaml")})
    raise CpctlError(f"--profile {name}: no such profile{suggest(name, known, kind='profiles')}")


# ----------------------------------------------------------------------------- text sources


def text_layer(texts: Mapping[str, Any], *, source_of: Callable[[Key], str]) -> Layer:
    """Key path -> text (or typed) values, each parsed and checked; errors name its source."""
    values = {path: KEYS[path].parse(text, source=source_of(KEYS[path])) for path, text in texts.items()}
    return Layer(values, {path: source_of(KEYS[path]) for path in values})


class FlagText(str):
    """A flag's text that says which flag it came from, when that is not the key's own `--<key>`
    (accelerate's spelling of a key: `--parallelism-config-cp-size`, see cpctl.launch.accelerate_flags)."""

    source: str

    def __new__(cls, text: str, *, source: str) -> FlagText:
        made = super().__new__(cls, text)
        made.source = source
        return made


def flag_layer(flags: Mapping[str, Any]) -> Layer:
    given = {p: v for p, v in flags.items() if v is not None}
    return text_layer(given, source_of=lambda k: MachineSource(getattr(given[k.path], "source", f"flag {k.flag}")))


def env_layer(environ: Mapping[str, str]) -> Layer:
    """The CPCTL_<KEY> environment variables."""
    by_var = {k.env_var: k.path for k in BY_NAME.values()}
    from cpctl.failure_report import ERROR_DIR_ENV_VAR

    internal = {PROFILE_ENV_VAR, ERROR_DIR_ENV_VAR}  # what cpctl launch hands its workers
    for retired_key in RETIRED.values():
        value = environ.get(retired_key.env_var)
        if value is not None and value != retired_key.accepted:
            raise CpctlError(f"environment: {retired_key.env_var}={value}: a retired key; {retired_key.reason}; "
                             "unset it")
    retired = {retired_key.env_var for retired_key in RETIRED.values()}
    unknown = [name for name in environ
               if name.startswith("CPCTL_") and name not in by_var and name not in internal and name not in retired]
    if unknown:
        raise CpctlError(f"environment: {unknown[0]}: unknown variable{suggest(unknown[0], by_var, kind='variables')}")
    return text_layer({by_var[name]: text for name, text in environ.items() if name in by_var},
                      source_of=lambda k: MachineSource(f"env {k.env_var}"))


def slurm_layer(environ: Mapping[str, str]) -> Layer:
    """nnodes, node_rank and the rendezvous host from SLURM's variables, when under SLURM."""
    if "SLURM_JOB_ID" not in environ:
        return Layer()
    texts: dict[str, str] = {}
    nnodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if nnodes:
        texts["launch.nnodes"] = nnodes
    if "SLURM_NODEID" in environ:
        texts["launch.node_rank"] = environ["SLURM_NODEID"]
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist and nnodes and nnodes.strip().isdigit() and int(nnodes) > 1:
        texts["launch.rdzv_endpoint"] = f"{first_slurm_host(nodelist)}:{DEFAULT_RDZV_PORT}"
    return text_layer(texts, source_of=lambda k: MachineSource("SLURM"))


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist: `gpu[003-010,012],cpu1` -> `gpu003`."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise CpctlError(f"SLURM: cannot read the node list {nodelist!r}; pass --rdzv-endpoint HOST:PORT")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def torchrun_layer(environ: Mapping[str, str]) -> Layer:
    """Inside a worker started by plain torchrun: the world it was actually started with."""
    world = int(environ.get("WORLD_SIZE", "1"))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    texts: dict[str, Any] = {"launch.nproc_per_node": local_world, "launch.nnodes": world // local_world}
    if world == 1:  # plain `python script.py`: nothing to parallelise
        texts.update({f"parallelism.{name}": 1 for name in ("dp_replicate_size", "dp_shard_size", "cp_size", "sp_size",
                                                             "tp_size")})
    if world > local_world:
        texts["launch.rdzv_endpoint"] = f"{environ.get('MASTER_ADDR', 'localhost')}:{environ.get('MASTER_PORT', '29500')}"
    return text_layer(texts, source_of=lambda k: "torchrun environment")


def overrides_layer(overrides: Mapping[str, Any]) -> Layer:
    """cpctl.init(cp_size=2, fsdp_version=2, ...): keys by their flag names, with underscores."""
    for name in overrides:
        if name not in BY_NAME:
            raise CpctlError(f"cpctl.init({name}=...): unknown profile key{suggest(name, BY_NAME)}")
    return text_layer({BY_NAME[name].path: value for name, value in overrides.items()},
                      source_of=lambda k: f"cpctl.init({k.name}=...)")
