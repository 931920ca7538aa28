"""The profile: its keys (schema), where values come from (layers), what they must satisfy
together (rules), and how they combine into one resolved Profile (resolve). Torch-free."""

from cpctl.config.layers import (
    LOCAL_PROFILE,
    PROFILE_ENV_VAR,
    USER_PROFILE_NAME,
    Layer,
    file_layer,
    find_profile,
    read_yaml,
    to_yaml,
    tree_layer,
    user_config_dir,
)
from cpctl.config.resolve import Preview, Resolved, for_worker, merge_layers, preview, resolve
from cpctl.config.rules import Machine, detect_machine, fill_auto, first_problem, target_machine
from cpctl.config.schema import AUTO, BY_NAME, CPU_DEFAULT_NPROC, DEFAULTS, KEYS, PROFILE_VERSION, STRATEGIES, Fsdp, Key, Launch, Parallelism, Profile, to_tree

__all__ = [
    "AUTO", "BY_NAME", "CPU_DEFAULT_NPROC", "DEFAULTS", "KEYS", "LOCAL_PROFILE", "PROFILE_ENV_VAR", "PROFILE_VERSION",
    "STRATEGIES", "USER_PROFILE_NAME", "Fsdp", "Key", "Launch", "Layer", "Machine", "Parallelism", "Profile",
    "Preview", "Resolved", "detect_machine", "file_layer", "fill_auto", "find_profile", "first_problem", "for_worker",
    "merge_layers", "preview", "read_yaml", "resolve", "target_machine", "to_tree", "to_yaml", "tree_layer", "user_config_dir",
]
