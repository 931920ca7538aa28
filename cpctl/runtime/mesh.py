"""The DeviceMesh a resolved profile implies: axes dp_replicate, dp_shard, cp, sp, tp, plus the
flattened and combined ones that FSDP, the loss and the data loader use.

The axis order is the one `cpctl.layout` prints in `cpctl launch --dry-run`; tp varies
fastest so tensor-parallel peers share a node.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpctl.config import Parallelism
from cpctl.layout import MESH_AXES, axis_sizes

# Flattened axes: "dp" (how many batches a step sees), "dp_shard_cp" (what FSDP shards over),
# "dp_cp" (every rank that holds different tokens: loss normalisation), "cp_sp" (the ranks that
# split one sequence, cp-major). Ulysses ranks (sp) hold different tokens too, so they count
# wherever cp does.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp", "sp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp", "sp"),
    "cp_sp": ("cp", "sp"),
}


def build_mesh(parallelism: Parallelism, *, device_type: str) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """The root mesh, and every named sub-mesh: each axis, each flattened axis, and "fsdp"
    (what FSDP2 shards over: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP).

    Each flattened mesh is made once here and kept, as newer torch wants; the 2-D HSDP mesh is
    the root sliced by the flattened axis's name, the way torch (and torchtitan) form it.
    """
    mesh = init_device_mesh(device_type, axis_sizes(parallelism), mesh_dim_names=MESH_AXES)
    axes = {name: mesh[name] for name in MESH_AXES}
    for name, parts in FLATTENED.items():
        axes[name] = mesh[parts]._flatten(name)  # torchtitan's spelling of the same step
    axes["fsdp"] = mesh["dp_replicate", "dp_shard_cp"] if parallelism.dp_replicate_size > 1 else axes["dp_shard_cp"]
    return mesh, axes
