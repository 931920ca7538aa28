"""Whether a checkpoint's files are the ones that were written: sizes and checksums per file.

After a save, each rank records the files it wrote (its `__R_*.distcp` shards and its
metadata; rank 0 also the global `.metadata`) with their sizes and the CRC32 of every 64 MiB
piece, in `rankR-cpctl-files.json`. Before a load, the ranks divide the files between them
and check each: a file missing, truncated or changed since it was written is named, instead of
PyTorch's `CheckpointException ranks:dict_keys([0, 1])`, or, where a changed byte unpickles
fine, a silently different model. Checkpoints written before these records existed are checked
against the sizes their `.metadata` lists.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "rank{rank}-cpctl-files.json"
PIECE = 64 << 20  # bytes per checksum: pieces are checked in parallel threads (zlib releases the GIL)
_THREADS = 8


@dataclass(frozen=True)
class Damage:
    """What is wrong with one file of a checkpoint."""

    file: str  # its name inside the checkpoint
    what: str  # "truncated: 1,000 of 789,136 bytes", "missing", ...


def written_by(directory: Path, *, rank: int, meta_name: str) -> list[str]:
    """The files of `directory` that rank `rank` wrote in a save."""
    names = sorted(path.name for path in directory.glob(f"__{rank}_*.distcp"))
    names.append(meta_name)
    if rank == 0:
        names.append(".metadata")
    return names


def record(directory: Path, *, rank: int, world: int, names: list[str]) -> None:
    """Write this rank's record of `names` (sizes and checksums), read back from disk."""
    entries = {name: {"size": (directory / name).stat().st_size, "crc32": _checksums(directory / name)}
               for name in names}
    path = directory / MANIFEST.format(rank=rank)
    path.write_text(json.dumps({"world": world, "files": entries}))
    with open(path, "rb+") as handle:  # the record reaches the disk with the files it vouches for
        os.fsync(handle.fileno())


def entries(directory: Path) -> tuple[dict[str, dict], Damage | None]:
    """Every file the records list, with its record; or the first record that is missing or unreadable.
    Empty (and no damage) for a checkpoint written before records existed."""
    first = directory / MANIFEST.format(rank=0)
    if not first.exists():
        return {}, None
    listed: dict[str, dict] = {}
    world = None
    rank = 0
    while world is None or rank < world:
        path = directory / MANIFEST.format(rank=rank)
        try:
            manifest = json.loads(path.read_text())
            world = int(manifest["world"]) if world is None else world
            listed.update(manifest["files"])
        except FileNotFoundError:
            return {}, Damage(path.name, "missing")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return {}, Damage(path.name, f"cannot be read ({exc.__class__.__name__})")
        rank += 1
    return listed, None


def check(directory: Path, names: list[str], listed: dict[str, dict]) -> Damage | None:
    """The first of `names` whose size or checksums differ from its record."""
    for name in names:
        path, want = directory / name, listed[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return Damage(name, "missing")
        if size != want["size"]:
            return Damage(name, f"{'truncated' if size < want['size'] else 'longer than written'}: {size:,} bytes, "
                                f"{want['size']:,} written")
        try:
            if _checksums(path) != want["crc32"]:
                return Damage(name, "changed since it was written: its checksum differs")
        except OSError as exc:
            return Damage(name, f"cannot be read ({exc.strerror or exc})")
    return None


def check_sizes_from_metadata(directory: Path) -> Damage | None:
    """A checkpoint without records: every file `.metadata` lists holds the bytes it points to."""
    import pickle

    try:
        with open(directory / ".metadata", "rb") as handle:
            metadata = pickle.load(handle)
    except FileNotFoundError:
        return Damage(".metadata", "missing")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is damaged
        return Damage(".metadata", f"cannot be read ({exc.__class__.__name__})")
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.exists():
            return Damage(name, "missing")
        if path.stat().st_size < size:
            return Damage(name, f"truncated: {path.stat().st_size:,} bytes, {size:,} written")
    return None


def _checksums(path: Path) -> list[int]:
    size = path.stat().st_size
    offsets = list(range(0, size, PIECE)) or [0]

    def piece(offset: int) -> int:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return zlib.crc32(handle.read(PIECE))

    if len(offsets) == 1:
        return [piece(0)]
    with ThreadPoolExecutor(max_workers=min(_THREADS, len(offsets))) as pool:
        return list(pool.map(piece, offsets))
