"""Every profile key, declared once.

A key is a field of one of the section dataclasses below, and its `key(...)` metadata says
how its text parses, which values it allows, its default, its help and the wizard's question.
Everything else is derived from these declarations: the flat key paths, the `--<key>` flags,
the `CPCTL_<KEY>` variables, the wizard's questions and the dry run's table. Adding a key is
one edit here.

The dataclasses hold a *resolved* profile: no `auto` left, plain ints. Unresolved values
(layers, the wizard's answers) are flat mappings of key path to value until `resolve` builds
the Profile.

This module never imports torch: `cpctl launch --dry-run` and `cpctl check` stay fast.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpctl.errors import CpctlError
from cpctl.planner.shapes import PRESETS  # torch-free: the planner's arithmetic, no model code
from cpctl.strategy import Strategy

AUTO = "auto"
FIT = "fit"  # memory.selective_blocks: as many as fit, chosen by the runtime at the first step
PROFILE_VERSION = 1
STRATEGIES = tuple(strategy.value for strategy in Strategy)
PRECISIONS = ("bf16", "fp16", "no")
CPU_DEFAULT_NPROC = 2

Flat = dict[str, Any]  # key path ("parallelism.cp_size") -> value


QUOTED_VALUE_CHARS = 60  # how much of a bad value an error message repeats


def shown(value: Any) -> str:
    """`repr(value)`, cut short for error messages."""
    text = repr(value)
    return text if len(text) <= QUOTED_VALUE_CHARS else text[:QUOTED_VALUE_CHARS] + "...'"


# ----------------------------------------------------------------------------- value kinds


@dataclass(frozen=True)
class Kind:
    """How a key's values are written (text), checked and described."""

    allowed: str
    check: Callable[[Any], bool]
    parse: Callable[[str], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def integer(*, minimum: int, auto: bool = False) -> Kind:
    allowed = f"an integer >= {minimum}" + (" or auto" if auto else "")

    def check(value: Any) -> bool:
        return (auto and value == AUTO) or (_is_int(value) and value >= minimum)

    def parse(text: str) -> Any:
        return AUTO if auto and text.strip().lower() == AUTO else int(text)

    return Kind(allowed, check, parse)


def integer_or(word: str, *, minimum: int) -> Kind:
    """An integer, or a word that leaves the number to be chosen later (not against the machine, as auto is)."""

    def parse(text: str) -> Any:
        return word if text.strip().lower() == word else int(text)

    return Kind(f"an integer >= {minimum} or {word}", lambda value: value == word or (_is_int(value) and value >= minimum),
                parse)


def one_of(*choices: Any) -> Kind:
    allowed = " or ".join(map(str, choices)) if len(choices) <= 2 else ", ".join(map(str, choices))

    def parse(text: str) -> Any:
        stripped = text.strip()
        return int(stripped) if all(_is_int(c) for c in choices) else stripped

    return Kind(allowed, lambda value: not isinstance(value, bool) and value in choices, parse)


SWITCH = Kind("true or false", lambda value: isinstance(value, bool), _parse_bool)


def _endpoint(value: Any) -> bool:
    if value is None:
        return True
    match = isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})", value)
    return bool(match) and 1 <= int(match.group(1)) <= 65535


def _model(value: Any) -> bool:
    return value is None or (isinstance(value, str) and bool(value.strip()))


MODEL = Kind(f"a preset ({', '.join(PRESETS)}), a Hugging Face config.json or its "
             "directory, or null", _model,
             lambda text: None if text.strip().lower() in ("", "null", "none") else text.strip())

ENDPOINT = Kind("host:port (port 1-65535) or null", _endpoint,
                lambda text: None if text.strip().lower() in ("", "null", "none") else text.strip())


# ----------------------------------------------------------------------------- declaring a key


@dataclass(frozen=True)
class Spec:
    kind: Kind
    default: Any  # the built-in default; AUTO for keys resolved against the machine
    help: str
    prompt: str | None = None  # the wizard's question; None: never asked (default unless given)
    choices: Mapping[Any, str] | None = None  # a select's options, each with one line of help
    name: str | None = None  # flag/env/override name when the leaf alone is ambiguous


def key(kind: Kind, default: Any, help: str, **options: Any) -> Any:  # noqa: A002 - the field's help text
    return field(metadata={"cpctl": Spec(kind, default, help, **options)})


@dataclass(frozen=True)
class Parallelism:
    dp_replicate_size: int = key(integer(minimum=1), 1, "HSDP replicas (full copies of the sharded model)",
                                 prompt="DP replicate size: HSDP replicas (full copies of the sharded model)")
    dp_shard_size: int = key(integer(minimum=1, auto=True), AUTO, "FSDP shards; auto = world / (dp_replicate * cp * sp * tp)",
                             prompt="DP shard size: FSDP shards")
    cp_size: int = key(integer(minimum=1), 1, "ranks that split each sequence (context parallelism)",
                       prompt="CP size: ranks that split each sequence")
    sp_size: int = key(integer(minimum=1, auto=True), 1, "Ulysses ranks: they split attention heads inside attention "
                       "and the sequence outside it, within each cp rank's share (sequence shards = cp x sp); auto: "
                       "the cp_size ranks of each sequence are split into sp x cp from the model's heads and the "
                       "machines (Ulysses within a node, the ring across), which needs `model`",
                       prompt="SP size (Ulysses): ranks that split attention heads, within one machine")
    tp_size: int = key(integer(minimum=1), 1, "tensor-parallel ranks", prompt="TP size: tensor-parallel ranks")
    cp_comm_strategy: str = key(one_of(*STRATEGIES), "allgather", "how K/V move between CP ranks",
                                prompt="CP comm strategy: how K/V move between CP ranks", choices={
                                    "allgather": "allgather  gather all K/V once: fewest messages, more memory",
                                    "alltoall": "alltoall   ring rotation of K/V blocks: overlaps with compute, constant memory",
                                })
    cp_engine: str = key(one_of("cpctl", "native"), "cpctl", "what computes attention across the CP group in an "
                         "accelerate script: cpctl's engine (cpu and cuda, windows, packed documents, checks), or "
                         "native: PyTorch's context_parallel as accelerate runs it (cuda only)",
                         prompt="Engine behind accelerate's maybe_context_parallel", choices={
                             "cpctl": "cpctl   cpctl's engine: cpu and cuda, windows, packed documents, checks",
                             "native": "native  accelerate's own path, PyTorch's context_parallel (cuda only)",
                         })
    cp_load_balance: bool = key(SWITCH, True, "head-tail sharding so causal work is even per rank",
                                prompt="Load balance: head-tail sharding so causal attention work is even per rank?")


@dataclass(frozen=True)
class Fsdp:
    version: int = key(one_of(1, 2), 2, "FSDP version (CP needs 2)", name="fsdp_version")
    reshard_after_forward: bool = key(SWITCH, True, "free gathered parameters after forward")
    mixed_precision: str = key(one_of(AUTO, *PRECISIONS), AUTO, "parameter dtype for compute",
                               prompt="Mixed precision", choices={
                                   "auto": "auto  bf16 on cuda, no on cpu",
                                   "bf16": "bf16  bfloat16 compute (Ampere or newer GPUs)",
                                   "fp16": "fp16  float16 compute (older GPUs)",
                                   "no": "no    full fp32",
                               })
    activation_checkpointing: bool = key(SWITCH, False, "recompute block activations in backward",
                                         prompt="Activation checkpointing: recompute block activations in backward "
                                                "to save memory?")
    # Not asked by `cpctl config`: keep (pure low precision) is a choice to make knowingly, never a default.
    master_weights: str = key(one_of("fp32", "keep"), "fp32", "the dtype of the trainable parameters FSDP2 shards, "
                              "their gradients and AdamW's state: fp32 (bf16 or fp16 weights, as transformers loads a "
                              "checkpoint, are upcast before sharding; compute still runs in mixed_precision), or "
                              "keep: train them in the dtype they arrive in (pure low precision: updates below "
                              "bf16's resolution are lost); frozen parameters always keep theirs")


@dataclass(frozen=True)
class Memory:
    loss_chunk_tokens: int = key(integer(minimum=1), 4096, "tokens per chunk of rt.causal_lm_loss, which never "
                                 "holds the full logits (smaller: less memory, more kernel calls)",
                                 prompt="Tokens per chunk of the chunked loss (rt.causal_lm_loss)")
    checkpoint_level: str = key(one_of("full", "selective", "mixed"), "full", "with activation checkpointing: full "
                                "recomputes whole blocks in backward; selective keeps what attention saved, so "
                                "attention and its CP exchange run once; mixed: selective for as many blocks as "
                                "memory allows (memory.selective_blocks), full for the rest", prompt="Checkpointing level",
                                choices={"full": "full       least memory: recompute whole blocks, attention included",
                                         "selective": "selective  faster: keep attention's tensors (Q, K, V, output), "
                                                      "recompute the rest",
                                         "mixed": "mixed      selective for as many blocks as fit (cpctl plan's memory "
                                                  "model), full for the rest"})
    selective_blocks: int | str = key(integer_or(FIT, minimum=0), FIT, "with checkpoint_level mixed: how many blocks "
                                      "(the last ones) are selective, the rest full; fit: as many as fit on this GPU by "
                                      "cpctl plan's memory model, chosen at the first step",
                                      prompt="Selective blocks (fit = as many as fit, chosen at the first step)")
    tiled_mlp_tokens: int = key(integer(minimum=0), 0, "run each block's MLP over the sequence in tiles of this "
                                "many tokens, recomputed per tile in backward (0: off)",
                                prompt="Tiled MLP: tokens per tile, each recomputed in backward")
    tiled_norm_tokens: int = key(integer(minimum=0), 0, "run the LayerNorm/RMSNorm layers (each block's and the final "
                                 "one) over the sequence in tiles of this many tokens, recomputed per tile in backward: "
                                 "their fp32 copies and backward exist for one tile (0: off)",
                                 prompt="Tiled norms: tokens per tile, each recomputed in backward")
    offload_activations: bool = key(SWITCH, False, "keep the tensors saved for backward (with activation "
                                    "checkpointing: the block inputs) in pinned CPU memory (cuda only)",
                                    prompt="Offload the checkpointed block inputs to pinned CPU memory?")
    cpu_offload: bool = key(SWITCH, False, "keep parameters, gradients and optimizer state in CPU memory between "
                            "uses (FSDP2's CPUOffloadPolicy; cuda only)",
                            prompt="Keep parameters, gradients and optimizer state in CPU memory (slower)?")


@dataclass(frozen=True)
class Launch:
    device: str = key(one_of(AUTO, "cuda", "cpu"), AUTO, "cuda, cpu, or auto (cuda if a GPU is visible)",
                      prompt="Device", choices={
                          "cuda": "cuda  NVIDIA GPUs, NCCL",
                          "cpu": "cpu   CPU processes, gloo (to try CP out on a laptop or in CI)",
                      })
    nnodes: int = key(integer(minimum=1), 1, "machines", prompt="Machines (nnodes)")
    nproc_per_node: int = key(integer(minimum=1, auto=True), AUTO, "worker processes per machine",
                              prompt="Processes per machine (nproc_per_node)")
    # Not asked by `cpctl config`: a profile is shared by every machine, the node rank is each one's own.
    node_rank: int = key(integer(minimum=0), 0, "this machine's index among nnodes; 0 hosts the rendezvous and runs global rank 0")
    rdzv_endpoint: str | None = key(ENDPOINT, None, "rendezvous address for several machines",
                                    prompt="Rendezvous endpoint, host:port of the node_rank-0 machine")
    max_restarts: int = key(integer(minimum=0), 0, "times the elastic agent restarts failed workers")
    comm_timeout: int = key(integer(minimum=1), 1800, "seconds a collective waits for its peers before the job "
                            "fails and names the rank that stopped answering (every process group)")
    script_api: str = key(one_of(AUTO, "cpctl", "accelerate"), AUTO, "what the script is written with: cpctl's "
                          "runtime (import cpctl), or accelerate (an Accelerator, or a transformers or TRL Trainer), "
                          "which cpctl launch then configures as `accelerate launch` would; auto: read from the "
                          "script's source at launch", prompt="The training script uses",
                          choices={"auto": "auto        decided at launch from the script's source (cpctl.init(): "
                                           "cpctl; an Accelerator or Trainer: accelerate)",
                                   "cpctl": "cpctl       cpctl's runtime: rt = cpctl.init()",
                                   "accelerate": "accelerate  accelerate's Accelerator, or a transformers Trainer"})


@dataclass(frozen=True)
class Profile:
    version: int = key(one_of(PROFILE_VERSION), PROFILE_VERSION, "profile format version")
    model: str | None = key(MODEL, None, "the model the script trains, for what depends on its shape: sp_size auto "
                            "and cpctl plan (read where they need it; a relative path is from where cpctl runs)",
                            prompt="The model, for sp_size auto (a preset, or a Hugging Face config.json or its "
                                   "directory)")
    parallelism: Parallelism
    fsdp: Fsdp
    memory: Memory
    launch: Launch

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    def get(self, path: str) -> Any:
        section, _, name = path.rpartition(".")
        return getattr(getattr(self, section) if section else self, name)

    def to_flat(self) -> Flat:
        return {path: self.get(path) for path in KEYS}

    def to_dict(self) -> dict[str, Any]:
        return to_tree(self.to_flat())

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> Profile:
        return cls.from_flat(flatten(tree))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> Profile:
        """A resolved profile from a complete flat mapping with no `auto` left."""
        missing = [path for path in KEYS if path not in values]
        unresolved = [path for path in KEYS if values.get(path) == AUTO]
        if missing or unresolved:
            raise ValueError(f"unresolved profile keys: {missing or unresolved}")
        sections = {name: section(**{k: values[f"{name}.{k}"] for k in _field_names(section)})
                    for name, section in SECTIONS.items()}
        return cls(**{path: values[path] for path in KEYS if "." not in path}, **sections)


class NamedKey:
    """A key's flag and environment variable, both derived from its `name` (`cp_size`: `--cp-size`,
    `CPCTL_CP_SIZE`), for the keys profiles have and for those they once had."""

    name: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return "CPCTL_" + self.name.upper()


@dataclass(frozen=True)
class Retired(NamedKey):
    """A key profiles once had: the one value still read (as nothing to do), and why the key went.
    `reason` says no more than why: each source (file, variable, flag) adds how to drop it there."""

    name: str
    accepted: Any
    reason: str


RETIRED: dict[str, Retired] = {retired.name: retired for retired in (
    Retired("attention", "sdpa", "cpctl computes attention through SDPA at every cp and sp size (a Hugging Face "
                                 "model needs attn_implementation='sdpa')"),
)}

SECTIONS: dict[str, type] = {"parallelism": Parallelism, "fsdp": Fsdp, "memory": Memory, "launch": Launch}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# ----------------------------------------------------------------------------- the derived view


@dataclass(frozen=True)
class Key(NamedKey):
    """One key as the rest of cpctl sees it: its path and the names derived from it."""

    path: str
    spec: Spec

    @property
    def leaf(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def name(self) -> str:
        """`cp_size`, `fsdp_version`: for cpctl.init(**overrides), and the base of flag and env names."""
        return self.spec.name or self.leaf

    @property
    def allowed(self) -> str:
        return self.spec.kind.allowed

    @property
    def help(self) -> str:
        return self.spec.help

    @property
    def default(self) -> Any:
        return self.spec.default

    def check(self, value: Any) -> bool:
        return self.spec.kind.check(value)

    def parse(self, text: Any, *, source: str) -> Any:
        """A checked value from text (a flag, a variable) or an already typed value; errors name `source`."""
        try:
            value = self.spec.kind.parse(text) if isinstance(text, str) else text
        except ValueError:
            raise CpctlError(f"{source}: {shown(text)} is not allowed for {self.path}; expected {self.allowed}") from None
        if not self.check(value):
            raise CpctlError(f"{source}: {shown(value)} is not allowed for {self.path}; expected {self.allowed}")
        return value


def _walk(cls: type, prefix: str = "") -> Iterator[Key]:
    for f in dataclasses.fields(cls):
        if "cpctl" in f.metadata:
            yield Key(prefix + f.name, f.metadata["cpctl"])
        else:
            yield from _walk(SECTIONS[f.name], f"{f.name}.")


KEYS: dict[str, Key] = {k.path: k for k in _walk(Profile)}
DEFAULTS: Flat = {path: k.default for path, k in KEYS.items()}
BY_NAME: dict[str, Key] = {k.name: k for k in KEYS.values() if k.path != "version"}


# ----------------------------------------------------------------------------- flat <-> nested


def to_tree(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flat key paths -> the nested mapping a YAML profile holds, in schema order."""
    tree: dict[str, Any] = {}
    for path in KEYS:
        if path in values:
            section, _, name = path.rpartition(".")
            (tree.setdefault(section, {}) if section else tree)[name] = values[path]
    return tree


def flatten(tree: Mapping[str, Any]) -> Flat:
    """A nested profile mapping -> flat key paths (sections that are not mappings kept as is)."""
    flat: Flat = {}
    for name, value in tree.items():
        if name in SECTIONS and isinstance(value, Mapping):
            flat.update({f"{name}.{sub}": v for sub, v in value.items()})
        else:
            flat[name] = value
    return flat
