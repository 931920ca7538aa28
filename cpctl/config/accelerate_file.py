"""accelerate's config file (what `accelerate config` writes, what its examples ship) as a profile layer.

`cpctl launch --config accelerate_config.yaml` and `cpctl config --from-accelerate FILE` read it:
each setting cpctl honours becomes its profile key (the launch, the parallel sizes, FSDP2, the
precision; and `launch.script_api: accelerate`, since such a file is for an accelerate script);
settings that change nothing cpctl computes (accelerate's bookkeeping, TPU fields on a GPU
machine) are passed over; anything cpctl cannot honour is refused by its name, in one line.

The keys are accelerate 1.15's (accelerate/commands/config/config_args.py and the FSDP plugin's
`fsdp_*` names). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpctl.config.schema import KEYS
from cpctl.errors import CpctlError

# Top-level keys only accelerate's files have: one of them marks a file as accelerate's.
MARKERS = ("compute_environment", "distributed_type", "num_processes", "fsdp_config", "parallelism_config",
           "mixed_precision", "use_cpu", "main_training_function")
# Settings with no effect on what cpctl runs (bookkeeping, other hardware's knobs left at rest).
PASSED_OVER = {
    "compute_environment": ("LOCAL_MACHINE",), "debug": None, "downcast_bf16": None, "enable_cpu_affinity": None,
    "main_training_function": None, "rdzv_backend": ("static", "c10d"), "same_network": None, "tpu_env": None,
    "tpu_use_cluster": None, "tpu_use_sudo": None, "tpu_name": None, "tpu_zone": None, "commands": None,
    "command_file": None, "gpu_ids": ("all",), "ipex_config": None, "mpirun_config": None,
}
FSDP_PASSED_OVER = {
    # accelerate's wrapping and loading knobs: cpctl shards each transformer block (the model's own)
    "fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",), "fsdp_transformer_layer_cls_to_wrap": None,
    "fsdp_cpu_ram_efficient_loading": None, "fsdp_sync_module_states": None, "fsdp_use_orig_params": None,
    "fsdp_forward_prefetch": None, "fsdp_backward_prefetch": None, "fsdp_backward_prefetch_policy": None,
    "fsdp_state_dict_type": ("SHARDED_STATE_DICT",),  # accelerate's default for FSDP2, which cpctl keeps
    "fsdp_sharding_strategy": None, "fsdp_min_num_params": None,
}


@dataclass(frozen=True)
class ParallelismSetting:
    """One of accelerate's ParallelismConfig settings, the same in both of its spellings:
    `parallelism_config_<name>` in its config file, `--parallelism-config-<name>` on `accelerate
    launch` (cpctl.launch.accelerate_flags builds its aliases from these)."""

    name: str
    path: str | None  # the profile key it sets; None: nothing to set (what it asks is what cpctl does)
    allowed: tuple[str, ...] = ()  # with nothing to set: the values that ask for what cpctl does (none: any)
    meaning: str = ""  # what it means to cpctl, where the key alone does not say it


_DEEPSPEED_KNOWS = "what DeepSpeed's Ulysses needs to know in advance; cpctl's takes each batch's length"
PARALLELISM: tuple[ParallelismSetting, ...] = (
    ParallelismSetting("dp_replicate_size", "parallelism.dp_replicate_size"),
    ParallelismSetting("dp_shard_size", "parallelism.dp_shard_size"),
    ParallelismSetting("tp_size", "parallelism.tp_size"),
    ParallelismSetting("cp_size", "parallelism.cp_size"),
    ParallelismSetting("cp_comm_strategy", "parallelism.cp_comm_strategy"),
    ParallelismSetting("sp_size", "parallelism.sp_size", meaning="sets parallelism.sp_size, as --sp-size does: "
                       "accelerate's DeepSpeed Ulysses becomes cpctl's, on FSDP2"),
    ParallelismSetting("sp_attn_implementation", None, allowed=("sdpa",),
                       meaning="sdpa: how cpctl computes attention at every cp and sp size"),
    ParallelismSetting("cp_backend", None, allowed=("torch",),
                       meaning="torch: accelerate's only backend for CP, the one cpctl configures"),
    ParallelismSetting("sp_backend", None, allowed=("deepspeed",),
                       meaning="deepspeed: accelerate's only backend for sp; cpctl runs that Ulysses itself, on FSDP2"),
    ParallelismSetting("sp_seq_length", None, meaning=_DEEPSPEED_KNOWS),
    ParallelismSetting("sp_seq_length_is_variable", None, meaning=_DEEPSPEED_KNOWS),
)
DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP")
PRECISIONS = ("no", "fp16", "bf16")


def is_accelerate_config(tree: Any) -> bool:
    return isinstance(tree, Mapping) and any(key in tree for key in MARKERS)


def values(tree: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Profile key paths -> values, from an accelerate config mapping (refusing what cpctl cannot honour)."""
    def refuse(what: str, fix: str) -> CpctlError:
        return CpctlError(f"{source}: {what}: {fix}")

    out: dict[str, Any] = {"launch.script_api": "accelerate"}
    handled = {"distributed_type", "num_processes", "num_machines", "machine_rank", "main_process_ip",
               "main_process_port", "mixed_precision", "use_cpu", "fsdp_config", "parallelism_config",
               "dynamo_config", "deepspeed_config"}
    for key, value in tree.items():
        if key in handled:
            continue
        if key not in PASSED_OVER:
            raise refuse(f"{key}: an accelerate setting cpctl does not know", "remove it, or set what it means with "
                         "cpctl's own options (cpctl launch --help)")
        allowed = PASSED_OVER[key]
        if allowed is not None and value is not None and str(value) not in allowed:
            raise refuse(f"{key}: {value}", f"cpctl launches on this machine's {', '.join(allowed)} only; "
                         f"set it to {allowed[0]} or remove it")

    kind = str(tree.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED" or tree.get("deepspeed_config"):
        raise refuse("distributed_type: DEEPSPEED", "cpctl shards with FSDP2; use an FSDP (version 2) config")
    if kind not in DISTRIBUTED:
        raise refuse(f"distributed_type: {kind}", f"cpctl runs {', '.join(DISTRIBUTED)} on GPUs or the CPU")
    dynamo = tree.get("dynamo_config") or {}
    if str(dynamo.get("dynamo_backend", "NO")).upper() != "NO":
        raise refuse(f"dynamo_config.dynamo_backend: {dynamo['dynamo_backend']}",
                     "cpctl does not compile the model; set it to NO (or call torch.compile in the script)")

    machines = int(tree.get("num_machines", 1) or 1)
    out["launch.nnodes"] = machines
    if tree.get("num_processes") is not None:
        total = int(tree["num_processes"])
        if total % machines:
            raise refuse(f"num_processes: {total}", f"it counts the processes of all {machines} machines and must "
                         "divide among them")
        out["launch.nproc_per_node"] = total // machines
    if machines > 1:
        if tree.get("machine_rank") is not None:  # absent: the file does not say which machine it is for
            out["launch.node_rank"] = int(tree["machine_rank"])
        if tree.get("main_process_ip"):
            out["launch.rdzv_endpoint"] = f"{tree['main_process_ip']}:{tree.get('main_process_port') or 29500}"
    if tree.get("use_cpu") is True:
        out["launch.device"] = "cpu"

    precision = tree.get("mixed_precision")
    if precision is not None:
        precision = "no" if precision is False else str(precision)
        if precision not in PRECISIONS:
            raise refuse(f"mixed_precision: {precision}", f"cpctl trains in {', '.join(PRECISIONS)}")
        out["fsdp.mixed_precision"] = precision

    out.update(_fsdp(tree.get("fsdp_config") or {}, refuse=refuse))
    out.update(_parallelism(tree.get("parallelism_config") or {}, source=source, refuse=refuse))
    return out


def _fsdp(fsdp: Mapping[str, Any], *, refuse) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fsdp.items():
        if key == "fsdp_version":
            out["fsdp.version"] = int(value)
        elif key == "fsdp_reshard_after_forward":
            text = str(value).upper()
            out["fsdp.reshard_after_forward"] = value is True or text in ("TRUE", "FULL_SHARD", "HYBRID_SHARD")
        elif key == "fsdp_offload_params":
            out["memory.cpu_offload"] = bool(value)
        elif key == "fsdp_activation_checkpointing":
            out["fsdp.activation_checkpointing"] = bool(value)
        elif key in FSDP_PASSED_OVER:
            allowed = FSDP_PASSED_OVER[key]
            if allowed is not None and str(value) not in allowed:
                raise refuse(f"fsdp_config.{key}: {value}", f"cpctl shards each transformer block; set it to "
                             f"{allowed[0]} or remove it")
        else:
            raise refuse(f"fsdp_config.{key}: an FSDP setting cpctl does not know", "remove it")
    return out


def _parallelism(parallelism: Mapping[str, Any], *, source: str, refuse) -> dict[str, Any]:
    prefix = "parallelism_config_"
    by_name = {setting.name: setting for setting in PARALLELISM}
    out: dict[str, Any] = {}
    for key, value in parallelism.items():
        setting = by_name.get(key.removeprefix(prefix))
        where = f"parallelism_config.{key}"
        if setting is None:
            raise refuse(f"{where}: a parallelism setting cpctl does not know", "remove it")
        if setting.path is not None:
            out[setting.path] = KEYS[setting.path].parse(value, source=f"{source}: {where}")  # as the flag's
        elif setting.allowed and value is not None and str(value) not in setting.allowed:
            raise refuse(f"{where}: {value}", f"expected {' or '.join(setting.allowed)} ({setting.meaning}); "
                         f"set it to {setting.allowed[0]} or remove it")
    return out
