"""The DeviceMesh a resolved profile implies, its axes by name, and this rank's place on it.

Axes dp_replicate, dp_shard, cp, sp, tp (the order `cpctl.layout` prints in `cpctl launch
--dry-run`; tp varies fastest so tensor-parallel peers share a node), plus the flattened and
combined ones that FSDP, the loss and the data loader use. Every axis is named by `Axis`; what
each size being above 1 means (Ulysses on, TP on, a split sequence, ...) is said here once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpctl.config import Parallelism
from cpctl.layout import MESH_AXES, axis_sizes


class Axis(str, Enum):
    """A named axis of the mesh: the five dimensions, and those made of several."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    SP = "sp"
    TP = "tp"
    DP = "dp"  # how many different batches a step sees
    DP_SHARD_CP = "dp_shard_cp"  # what FSDP shards parameters over
    DP_CP = "dp_cp"  # every rank that holds different tokens: the loss's normalisation
    CP_SP = "cp_sp"  # the ranks that split one sequence, cp-major
    FSDP = "fsdp"  # FSDP2's mesh: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP


# Ulysses ranks (sp) hold different tokens too, so they count wherever cp does.
FLATTENED = {
    Axis.DP: (Axis.DP_REPLICATE, Axis.DP_SHARD),
    Axis.DP_SHARD_CP: (Axis.DP_SHARD, Axis.CP, Axis.SP),
    Axis.DP_CP: (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.SP),
    Axis.CP_SP: (Axis.CP, Axis.SP),
}


class Axes(Mapping):
    """Every axis's mesh, looked up by `Axis` or by its name (`rt.axes["cp"]`)."""

    def __init__(self, meshes: dict[Axis, DeviceMesh]) -> None:
        self._meshes = meshes

    def __getitem__(self, axis: Axis | str) -> DeviceMesh:
        try:
            return self._meshes[Axis(axis)]
        except ValueError:
            raise KeyError(axis) from None

    def __iter__(self) -> Iterator[str]:
        return (axis.value for axis in self._meshes)

    def __len__(self) -> int:
        return len(self._meshes)


@dataclass(frozen=True)
class ParallelMesh:
    """The root mesh, every named sub-mesh, and this rank's coordinates on them."""

    root: DeviceMesh
    axes: Axes

    @classmethod
    def build(cls, parallelism: Parallelism, *, device_type: str) -> ParallelMesh:
        """Each flattened mesh is made once here and kept, as newer torch wants; the 2-D HSDP mesh
        is the root sliced by the flattened axis's name, the way torch (and torchtitan) form it."""
        root = init_device_mesh(device_type, axis_sizes(parallelism), mesh_dim_names=MESH_AXES)
        meshes = {Axis(name): root[name] for name in MESH_AXES}
        for axis, parts in FLATTENED.items():
            meshes[axis] = root[tuple(part.value for part in parts)]._flatten(axis.value)  # torchtitan's spelling
        hsdp = parallelism.dp_replicate_size > 1
        meshes[Axis.FSDP] = root[Axis.DP_REPLICATE.value, Axis.DP_SHARD_CP.value] if hsdp else meshes[Axis.DP_SHARD_CP]
        return cls(root=root, axes=Axes(meshes))

    def size(self, axis: Axis) -> int:
        return self.axes[axis].size()

    def local_rank(self, axis: Axis) -> int:
        return self.axes[axis].get_local_rank()

    def group(self, axis: Axis) -> dist.ProcessGroup:
        return self.axes[axis].get_group()

    def present(self, axis: Axis) -> DeviceMesh | None:
        """The axis's mesh where the dimension is there (more than one rank), else None."""
        return self.axes[axis] if self.size(axis) > 1 else None

    def sequence_leaders(self) -> list[int]:
        """The global ranks that hold the first shard of their sequence (one per cp x sp group), sorted:
        one copy of every sample the step sees."""
        grid, names = self.root.mesh, list(self.root.mesh_dim_names)
        for axis in (Axis.SP, Axis.CP):
            index = names.index(axis.value)
            grid, names = grid.select(index, 0), names[:index] + names[index + 1:]
        return sorted(grid.flatten().tolist())

    def groups(self) -> list[dist.ProcessGroup]:
        """The process group of every one-dimensional axis (what the communication timeout applies to)."""
        return [mesh.get_group() for mesh in self.axes.values() if mesh.ndim == 1]

    # ------------------------------------------------------------------ this rank's coordinates

    @property
    def cp_size(self) -> int:
        return self.size(Axis.CP)

    @property
    def cp_rank(self) -> int:
        return self.local_rank(Axis.CP)

    @property
    def sp_size(self) -> int:
        """Ulysses ranks: they split attention heads inside attention, and the cp rank's tokens outside it."""
        return self.size(Axis.SP)

    @property
    def sp_rank(self) -> int:
        return self.local_rank(Axis.SP)

    @property
    def seq_size(self) -> int:
        """How many ranks split one sequence: cp_size x sp_size."""
        return self.size(Axis.CP_SP)

    @property
    def seq_group(self) -> dist.ProcessGroup:
        """The ranks that split one sequence (cp-major, sp inner): shards, unshards and their checks go over it."""
        return self.group(Axis.CP_SP)

    @property
    def dp_size(self) -> int:
        return self.size(Axis.DP)

    @property
    def dp_rank(self) -> int:
        return self.local_rank(Axis.DP)

    def seq_rank_to_global(self, seq_rank: int) -> int:
        """The global rank of a rank of the sequence group (the cp group when sp_size is 1)."""
        return dist.get_process_group_ranks(self.seq_group)[seq_rank]

    # ------------------------------------------------------------------ what is on

    @property
    def sp_enabled(self) -> bool:
        """Ulysses: attention heads split over sp ranks."""
        return self.size(Axis.SP) > 1

    @property
    def tp_enabled(self) -> bool:
        return self.size(Axis.TP) > 1

    @property
    def seq_enabled(self) -> bool:
        """One sequence split over several ranks (cp x sp > 1): shards, gathers and their checks are collectives."""
        return self.size(Axis.CP_SP) > 1

    @property
    def dp_cp_enabled(self) -> bool:
        """Several ranks hold different tokens: gradients must be reduced over them."""
        return self.size(Axis.DP_CP) > 1
