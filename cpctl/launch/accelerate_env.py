"""What accelerate is told: a resolved profile as the environment `accelerate launch` would set.

`cpctl launch` runs a script written for accelerate (`launch.script_api: accelerate`) with the
variables `accelerate launch` sets for the same layout, so an unmodified `Accelerator()` (or a
transformers `Trainer`) builds the DeviceMesh, FSDP2 and mixed precision the profile says. The
names are the ones accelerate reads in the releases listed in cpctl.versions.KNOWN_ACCELERATE (checked in
accelerate/utils/launch.py, parallelism_config.py and utils/dataclasses.py); a worker refuses
any other release rather than set names it may no longer read.

Torch-free: `cpctl launch --dry-run` prints these variables.
"""

from __future__ import annotations

from typing import Any


def _switch(value: bool) -> str:
    return "true" if value else "false"


def accelerate_env(profile: Any) -> dict[str, str]:
    """The variables for every worker of an accelerate script (empty for a cpctl script)."""
    if profile.launch.script_api != "accelerate":
        return {}
    parallel, fsdp = profile.parallelism, profile.fsdp
    env = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(parallel.dp_replicate_size),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(parallel.dp_shard_size),
        "PARALLELISM_CONFIG_TP_SIZE": str(parallel.tp_size),
        "PARALLELISM_CONFIG_CP_SIZE": str(parallel.cp_size),
        "PARALLELISM_CONFIG_CP_BACKEND": "torch",
        "ACCELERATE_MIXED_PRECISION": fsdp.mixed_precision,
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": str(fsdp.version),
        "FSDP_RESHARD_AFTER_FORWARD": _switch(fsdp.reshard_after_forward),
        "FSDP_OFFLOAD_PARAMS": _switch(profile.memory.cpu_offload),
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        # On cpctl's engine cpctl checkpoints the blocks itself, with attention routed in the recompute.
        "FSDP_ACTIVATION_CHECKPOINTING": _switch(fsdp.activation_checkpointing and parallel.cp_engine == "native"),
    }
    if parallel.cp_size > 1:
        env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] = parallel.cp_comm_strategy
    if parallel.sp_size > 1:  # accelerate's DeepSpeed sp, which the worker runs on cpctl's Ulysses instead
        env["PARALLELISM_CONFIG_SP_SIZE"] = str(parallel.sp_size)
    if profile.launch.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    return env


#END
