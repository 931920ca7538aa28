"""Worker: cpctl.init(**overrides) on top of the launcher's profile fills `auto` values again."""

import json
import sys

import cpctl

rt = cpctl.init(cp_size=2, dp_shard_size="auto", mixed_precision="auto")
same = cpctl.init(cp_size=2, dp_shard_size="auto", mixed_precision="auto") is rt
try:
    cpctl.init(cp_size=1)
    changed = None
except cpctl.CpctlError as exc:
    changed = str(exc)
if rt.is_main:
    par, fsdp = rt.config.parallelism, rt.config.fsdp
    with open(sys.argv[1], "w") as f:
        json.dump({"cp": par.cp_size, "dp_shard": par.dp_shard_size, "mixed_precision": fsdp.mixed_precision,
                   "same": same, "changed": changed}, f)
