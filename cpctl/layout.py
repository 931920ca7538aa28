"""Which global rank holds which mesh coordinate, in pure Python.

The runtime builds its DeviceMesh with the axes in this same order (dp_replicate, dp_shard,
cp, sp, tp; tp varies fastest, then sp, so tensor-parallel and Ulysses peers, whose
collectives are the heaviest, are neighbours on one node), so the table
that `cpctl launch --dry-run` prints is the layout the workers will have.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpctl.config import Parallelism

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass(frozen=True)
class Coordinate:
    rank: int
    dp_replicate: int
    dp_shard: int
    cp: int
    sp: int
    tp: int


def axis_sizes(parallelism: Parallelism) -> tuple[int, int, int, int, int]:
    return (
        parallelism.dp_replicate_size,
        parallelism.dp_shard_size,
        parallelism.cp_size,
        parallelism.sp_size,
        parallelism.tp_size,
    )


def coordinate_of(rank: int, parallelism: Parallelism) -> Coordinate:
    """Row-major position of `rank` in the (dp_replicate, dp_shard, cp, sp, tp) grid."""
    coords = []
    remainder = rank
    for size in reversed(axis_sizes(parallelism)):
        coords.append(remainder % size)
        remainder //= size
    dp_replicate, dp_shard, cp, sp, tp = reversed(coords)
    return Coordinate(rank=rank, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, sp=sp, tp=tp)


def mesh_table(parallelism: Parallelism, world_size: int) -> list[Coordinate]:
    return [coordinate_of(rank, parallelism) for rank in range(world_size)]
