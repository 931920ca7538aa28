"""The DeviceMesh: axes dp_replicate, dp_shard, cp, tp, plus the flattened ones FSDP and losses use.

The axis order is the one `cpctl.layout` prints in `cpctl launch --dry-run`; tp varies
fastest so tensor-parallel peers share a node.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpctl.layout import MESH_AXES, axis_sizes
from cpctl.profile import Parallelism

# Flattened axes: "dp" (how many batches a step sees), "dp_shard_cp" (what FSDP shards over),
# "dp_cp" (every rank that holds different tokens: loss normalisation).
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def build_mesh(parallelism: Parallelism, *, device_type: str) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """The root mesh, and every axis by name (flattened ones included) as its own mesh.

    Newer torch wants flattened meshes kept by the caller rather than sliced from the root.
    """
    mesh = init_device_mesh(device_type, axis_sizes(parallelism), mesh_dim_names=MESH_AXES)
    axes = {name: mesh[name] for name in MESH_AXES}
    for name, parts in FLATTENED.items():
        axes[name] = mesh[parts]._flatten(name)  # torchtitan's spelling of the same step
    return mesh, axes
