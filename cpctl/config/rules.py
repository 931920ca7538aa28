"""What a profile's values must satisfy together, and what `auto` becomes on a machine.

One list of rules, each naming the keys it reads. `check` runs every rule whose keys are all
known: `resolve` on a whole profile, the wizard on the answers given so far, `check --static`
against the machine a profile is written for. A mistake therefore gets one message, wherever
it is made.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpctl.config.schema import AUTO, CPU_DEFAULT_NPROC, FIT, KEYS, Flat
from cpctl.topology import GPUS_PER_NODE

if TYPE_CHECKING:
    from cpctl.launch.script_api import ScriptUse


def gpus(count: int) -> str:
    """`1 GPU`, `8 GPUs`."""
    return f"{count} GPU{'' if count == 1 else 's'}"


class AutoChoice(str):
    """The source of a value `auto` chose: shown as "auto (REASON)", its reason kept as data
    (Resolved.auto_reason), so that nothing has to read it back out of the text."""

    reason: str

    def __new__(cls, reason: str) -> AutoChoice:
        made = super().__new__(cls, f"auto ({reason})")
        made.reason = reason
        return made


@dataclass(frozen=True)
class Machine:
    """What `auto` values resolve against. Filled without importing torch."""

    cuda_devices: int


def detect_machine(environ: Mapping[str, str] | None = None) -> Machine:
    """Count visible NVIDIA GPUs without importing torch (CUDA_VISIBLE_DEVICES, then the driver)."""
    environ = os.environ if environ is None else environ
    gpus = Path("/proc/driver/nvidia/gpus")
    installed = len(list(gpus.iterdir())) if gpus.is_dir() else None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return Machine(cuda_devices=cuda_visible_count(visible, installed=installed))
    return Machine(cuda_devices=installed or 0)


def cuda_visible_count(visible: str, *, installed: int | None) -> int:
    """The GPUs CUDA shows for CUDA_VISIBLE_DEVICES=`visible`: its entries in order, up to the first
    that names no GPU (not an index nor a GPU-/MIG- UUID, `-1`, an index past the `installed` ones
    where the driver says how many), as CUDA reads it (`NoDevFiles`, SLURM's, shows none)."""
    count = 0
    for entry in (part.strip() for part in visible.split(",")):
        if entry.isdigit():
            if installed is not None and int(entry) >= installed:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break
        count += 1
    return count


def target_machine(values: Mapping[str, Any], *, detected: Machine) -> tuple[Machine, str]:
    """The machine a profile is written for: a cuda profile gets as many GPUs as it asks per
    node, whatever this machine has (how `check --static` validates it on a CPU box)."""
    device = values.get("launch.device", AUTO)
    nproc = values.get("launch.nproc_per_node", AUTO)
    nnodes = values.get("launch.nnodes", 1)
    several = isinstance(nnodes, int) and nnodes > 1  # each of them such a machine
    if device == "cpu":
        return Machine(cuda_devices=0), f"{nnodes} CPU machines" if several else "a CPU machine"
    if device == "cuda":
        if isinstance(nproc, int):
            count, why = nproc, "nproc_per_node as given"
        elif detected.cuda_devices:
            count, why = detected.cuda_devices, f"nproc_per_node auto: the {gpus(detected.cuda_devices)} visible here"
        else:
            count = GPUS_PER_NODE  # the node a cuda profile with nproc_per_node auto is checked against, away from it
            why = (f"nproc_per_node auto and no GPU visible here: a node of {count} assumed; "
                   "pass --nproc-per-node N for another")
        nodes = f"{nnodes} nodes with {gpus(count)} each" if several else f"a node with {gpus(count)}"
        return Machine(cuda_devices=count), f"{nodes} ({why})"
    return detected, f"this machine ({gpus(detected.cuda_devices)} visible; device auto)"


# ----------------------------------------------------------------------------- auto


def fill_auto(values: Mapping[str, Any], *, machine: Machine, script: ScriptUse | None = None,
              sources: Mapping[str, str] | None = None) -> tuple[Flat, dict[str, str]]:
    """Every `auto` among `values` that the known values decide, and why; others stay `auto`
    (the rules then say what is wrong). `launch.script_api` is decided by the script's source
    (`script`, which raises CpctlError when it cannot decide); without a script, it is cpctl's.
    `parallelism.sp_size` by the model's shape (its `model` is read; CpctlError if it cannot be);
    `sources` (where each value came from) names the cp_size it splits."""
    filled, why = dict(values), {}
    if filled.get("launch.script_api") == AUTO and isinstance(filled.get("parallelism.cp_size"), int):
        sp = filled.get("parallelism.sp_size")
        if script is not None:  # the ranks that split a sequence (with sp auto, cp_size counts them all)
            api, reason = script.route(cp_size=filled["parallelism.cp_size"] * (sp if isinstance(sp, int) else 1))
        elif filled.get("parallelism.cp_engine") == "native":
            api, reason = "accelerate", "cp_engine native is accelerate's"
        else:
            api, reason = "cpctl", "no script to read"
        filled["launch.script_api"] = api
        why["launch.script_api"] = AutoChoice(reason)
    device = filled.get("launch.device")
    if device == AUTO:
        device = filled["launch.device"] = "cuda" if machine.cuda_devices > 0 else "cpu"
        why["launch.device"] = AutoChoice(f"{gpus(machine.cuda_devices)} visible")
    if filled.get("launch.nproc_per_node") == AUTO and device in ("cuda", "cpu"):
        count = machine.cuda_devices if device == "cuda" else CPU_DEFAULT_NPROC
        if count > 0:
            filled["launch.nproc_per_node"] = count
            why["launch.nproc_per_node"] = AutoChoice("visible GPUs") if device == "cuda" else AutoChoice(f"{count} on cpu")
    if filled.get("parallelism.sp_size") == AUTO:
        _split_sequence(filled, why, sources=sources or {})
    sizes = [filled.get(f"parallelism.{name}") for name in ("dp_replicate_size", "cp_size", "sp_size", "tp_size")]
    world = world_size(filled)
    if filled.get("parallelism.dp_shard_size") == AUTO and world and all(isinstance(s, int) for s in sizes):
        others = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        if world % others == 0:
            filled["parallelism.dp_shard_size"] = world // others
            why["parallelism.dp_shard_size"] = AutoChoice(f"world {world} / {others}")
    if filled.get("fsdp.mixed_precision") == AUTO and device in ("cuda", "cpu"):
        filled["fsdp.mixed_precision"] = "bf16" if device == "cuda" else "no"
        why["fsdp.mixed_precision"] = AutoChoice(device)
    return filled, why


def _split_sequence(filled: Flat, why: dict[str, str], *, sources: Mapping[str, str]) -> None:
    """sp_size auto: the cp_size ranks of each sequence become sp x cp, as planner/layouts.py
    chooses for the model on these machines. Unknown model or machines: left auto."""
    model, ranks = filled.get("model"), filled.get("parallelism.cp_size")
    tp, nproc = filled.get("parallelism.tp_size", 1), filled.get("launch.nproc_per_node")
    if model is None or not all(isinstance(n, int) for n in (ranks, tp, nproc)):
        return
    from cpctl.planner.layouts import choose_layout
    from cpctl.planner.shapes import load_model

    shape = load_model(model)
    layout = choose_layout(shape, seq_ranks=ranks, ranks_per_node=nproc, tp=tp)
    filled["parallelism.sp_size"], filled["parallelism.cp_size"] = layout.sp, layout.cp
    why["parallelism.sp_size"] = AutoChoice(f"{shape.name}: {layout.reason}")
    given = sources.get("parallelism.cp_size", "default")
    why["parallelism.cp_size"] = f"{given}: {ranks} ranks per sequence, split by sp_size auto into sp {layout.sp} x cp {layout.cp}"


def world_size(values: Mapping[str, Any]) -> int | None:
    nnodes, nproc = values.get("launch.nnodes"), values.get("launch.nproc_per_node")
    return nnodes * nproc if isinstance(nnodes, int) and isinstance(nproc, int) else None


# ----------------------------------------------------------------------------- rules

AXES = {"parallelism.dp_replicate_size": "dp_replicate", "parallelism.dp_shard_size": "dp_shard",
        "parallelism.cp_size": "cp", "parallelism.sp_size": "sp", "parallelism.tp_size": "tp"}


@dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # applied once all of these are known
    problem: Callable[[Mapping[str, Any], Machine | None], str | None]
    needs_machine: bool = False
    also_reads: tuple[str, ...] = ()  # read when known, without waiting for them


def _sizes_fit_world(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    world = world_size(v)
    if world is None:  # nproc_per_node auto with nothing to count
        return None
    # sizes not known yet (the wizard mid-way) or auto: the known ones must divide the world
    known = {name: v[path] for path, name in AXES.items() if v.get(path, AUTO) != AUTO}
    if known.get("sp", 1) == 1:  # Ulysses is named only where it is used
        known.pop("sp", None)
        axes = len(AXES) - 1
    else:
        axes = len(AXES)
    product = 1
    for size in known.values():
        product *= size
    factors = " * ".join(f"{name}({size})" for name, size in known.items())
    where = f"world size {world} (nnodes {v['launch.nnodes']} x nproc_per_node {v['launch.nproc_per_node']})"
    if len(known) < axes:
        if world % product:
            return (f"{factors} = {product} does not divide {where}; choose sizes whose product divides {world} "
                    "or change --nproc-per-node/--nnodes")
        return None
    if product != world:
        others = product // known["dp_shard"]
        fix = (f"set dp_shard_size: {world // others} (or auto)" if world % others == 0
               else "change the sizes or --nproc-per-node/--nnodes so that they multiply to the world size")
        return f"{factors} = {product} != {where}; {fix}"
    return None


def _nproc_counts_gpus(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["launch.device"] == "cuda" and v["launch.nproc_per_node"] == AUTO:
        return ("launch.device is cuda but no GPU is visible; use --device cpu or check CUDA_VISIBLE_DEVICES "
                "(for a profile meant for another machine, pass --nproc-per-node: its GPUs per machine)")
    return None


def _gpus_visible(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if machine is None or v["launch.device"] != "cuda":
        return None
    if machine.cuda_devices == 0:
        return "launch.device is cuda but no GPU is visible; use --device cpu or check CUDA_VISIBLE_DEVICES"
    nproc = v["launch.nproc_per_node"]
    if isinstance(nproc, int) and nproc > machine.cuda_devices:
        return (f"launch.nproc_per_node: {nproc} workers but {gpus(machine.cuda_devices)} visible; "
                f"use --nproc-per-node {machine.cuda_devices} or fewer (or --device cpu)")
    return None


def _cp_needs_fsdp2(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    cp, version = v["parallelism.cp_size"], v["fsdp.version"]
    if cp > 1 and version != 2:
        return f"fsdp.version: {version} with cp_size {cp}; context parallelism needs fsdp.version: 2"
    return None


def _sp_auto_needs_model(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["parallelism.sp_size"] == AUTO and v["model"] is None:
        return ("parallelism.sp_size: auto splits each sequence's ranks into Ulysses x ring from the model's attention "
                "heads; name the model (--model PRESET or a config.json, model: in the profile) or set sp_size to a number")
    return None


def _sp_needs_fsdp2(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    sp = v["parallelism.sp_size"]
    if sp == AUTO:
        return None
    if sp > 1 and v["fsdp.version"] != 2:
        return f"fsdp.version: {v['fsdp.version']} with sp_size {sp}; Ulysses sequence parallelism needs fsdp.version: 2"
    return None


def _node_rank_in_range(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    rank, nnodes = v["launch.node_rank"], v["launch.nnodes"]
    if rank >= nnodes:
        return f"launch.node_rank: {rank} must be below nnodes ({nnodes}): 0..{nnodes - 1}"
    return None


def _nodes_need_rendezvous(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    nnodes = v["launch.nnodes"]
    if nnodes > 1 and v["launch.rdzv_endpoint"] is None:
        return (f"launch.nnodes: {nnodes} machines need a rendezvous; pass --rdzv-endpoint HOST:PORT "
                "(the node-rank-0 host, e.g. node0:29500)")
    return None


def _offload_needs_gpus(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["launch.device"] != "cpu":
        return None
    for path in ("memory.offload_activations", "memory.cpu_offload"):
        if v[path]:
            return f"{path}: true on device cpu; it moves GPU memory to the CPU, on cpu there is nothing to move: set it to false"
    return None


def _offload_with_checkpoints(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["memory.offload_activations"] and not v["fsdp.activation_checkpointing"]:
        return ("memory.offload_activations: true without fsdp.activation_checkpointing would pin every activation "
                "of the step in host memory; set activation_checkpointing: true (then only the block inputs move)")
    return None


def _level_needs_checkpoints(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["memory.checkpoint_level"] != "full" and not v["fsdp.activation_checkpointing"]:
        return (f"memory.checkpoint_level: {v['memory.checkpoint_level']} without fsdp.activation_checkpointing: "
                "nothing is recomputed to select from; set activation_checkpointing: true (or remove the level)")
    return None


def _selective_blocks_need_auto(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    count, level = v["memory.selective_blocks"], v["memory.checkpoint_level"]
    if count != FIT and level != "mixed":
        return (f"memory.selective_blocks: {count} with checkpoint_level: {level}; a count of selective blocks is the "
                "mixed level's: set checkpoint_level: mixed (selective for that many blocks, full for the rest)")
    return None


def _native_engine_is_accelerates(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    if v["parallelism.cp_engine"] != "native":
        return None
    if v["launch.script_api"] != "accelerate":
        return ("parallelism.cp_engine: native is accelerate's own path; a cpctl script always runs on cpctl's engine: "
                "remove cp_engine, or set launch.script_api: accelerate")
    if v["launch.device"] == "cpu":
        return "parallelism.cp_engine: native (PyTorch's context_parallel) needs CUDA; set cp_engine: cpctl to run on cpu"
    cpctl_only = [f"{path}: {v[path]}" for path in CPCTL_MODEL_OPTIONS if v[path] != KEYS[path].default]
    if cpctl_only:
        return (f"{cpctl_only[0]} is applied by cpctl's engine, but with cp_engine: native accelerate runs the model "
                "unchanged; remove it or set cp_engine: cpctl")
    return None


# What cpctl does to an accelerate script's model on its own engine (off at their defaults).
CPCTL_MODEL_OPTIONS = ("memory.tiled_mlp_tokens", "memory.tiled_norm_tokens", "memory.offload_activations", "memory.checkpoint_level",
                       "memory.selective_blocks")


def _accelerate_limits(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    """Layouts an accelerate script cannot have: refused here, before any worker starts."""
    sp = v["parallelism.sp_size"]
    if v["launch.script_api"] != "accelerate" or sp == AUTO:
        return None
    if sp > 1 and v["parallelism.cp_engine"] == "native":
        return (f"sp_size {sp} with cp_engine: native: PyTorch's context_parallel has no Ulysses (accelerate's own "
                "sp runs on DeepSpeed); set cp_engine: cpctl, whose Ulysses runs it on FSDP2, or sp_size: 1")
    if v["parallelism.tp_size"] > 1:
        return (f"tp_size {v['parallelism.tp_size']} with launch.script_api: accelerate: cpctl does not yet check "
                "accelerate's tensor parallelism against its engine; set tp_size: 1")
    # accelerate sees the cp x sp ranks as its cp axis (cpctl.integrations.accelerate_sp)
    if v["parallelism.cp_size"] * sp > 1 and v["parallelism.dp_replicate_size"] > 1 and v["parallelism.dp_shard_size"] == 1:
        return ("cp_size or sp_size > 1 with dp_replicate_size > 1 and dp_shard_size 1: accelerate's ParallelismConfig "
                "refuses this layout; use dp_shard_size instead of dp_replicate_size")
    return None


def _keep_is_not_accelerates(v: Mapping[str, Any], machine: Machine | None) -> str | None:
    """accelerate's FSDP2 preparation upcasts every trainable parameter to fp32 under mixed
    precision (fsdp2_prepare_model): there, keep could not hold."""
    precision = v["fsdp.mixed_precision"]
    if v["fsdp.master_weights"] != "keep" or v["launch.script_api"] != "accelerate" or precision in ("no", AUTO):
        return None
    return (f"fsdp.master_weights: keep with an accelerate script and mixed_precision {precision}: accelerate's FSDP2 "
            "preparation upcasts trainable parameters to fp32 under mixed precision; set mixed_precision: no (the "
            "weights' own dtype is then the compute dtype) or master_weights: fp32")


RULES = (
    Rule(("launch.device", "launch.nproc_per_node"), _nproc_counts_gpus),
    Rule(("launch.device", "launch.nproc_per_node"), _gpus_visible, needs_machine=True),
    Rule(("launch.nnodes", "launch.nproc_per_node"), _sizes_fit_world, also_reads=tuple(AXES)),
    Rule(("parallelism.cp_size", "fsdp.version"), _cp_needs_fsdp2),
    Rule(("parallelism.sp_size", "model"), _sp_auto_needs_model),
    Rule(("parallelism.sp_size", "fsdp.version"), _sp_needs_fsdp2),
    Rule(("launch.node_rank", "launch.nnodes"), _node_rank_in_range),
    Rule(("launch.nnodes", "launch.rdzv_endpoint"), _nodes_need_rendezvous),
    Rule(("launch.device", "memory.offload_activations", "memory.cpu_offload"), _offload_needs_gpus),
    Rule(("memory.offload_activations", "fsdp.activation_checkpointing"), _offload_with_checkpoints),
    Rule(("memory.checkpoint_level", "fsdp.activation_checkpointing"), _level_needs_checkpoints),
    Rule(("memory.selective_blocks", "memory.checkpoint_level"), _selective_blocks_need_auto),
    Rule(("parallelism.cp_engine", "launch.script_api", "launch.device", *CPCTL_MODEL_OPTIONS), _native_engine_is_accelerates),
    Rule(("launch.script_api", "parallelism.sp_size", "parallelism.cp_engine", "parallelism.tp_size", "parallelism.cp_size",
          "parallelism.dp_replicate_size", "parallelism.dp_shard_size"), _accelerate_limits),
    Rule(("fsdp.master_weights", "launch.script_api", "fsdp.mixed_precision"), _keep_is_not_accelerates),
)


def first_problem(values: Mapping[str, Any], *, machine: Machine | None) -> str | None:
    """The first rule that the known `values` break (rules with an unknown key wait), else None."""
    for rule in RULES:
        if all(path in values for path in rule.keys) and (machine is not None or not rule.needs_machine):
            problem = rule.problem(values, machine)
            if problem is not None:
                return problem
    return None
