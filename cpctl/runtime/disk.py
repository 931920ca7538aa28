"""Why a write failed, in the words a user can act on: a full disk, a file-size limit, a directory
that cannot be written, or the OS's own reason. Checkpoints and saved models both say it so."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from cpctl.planner.units import GiB

SMALL_DISK = 64 << 20  # less free than this (or than what was being written) after a failed write: the disk filled up


def write_failure(cause: BaseException | None, exc: BaseException, *, directory: Path, kept: str, size: int,
                  on: str = "", room: str = "save to another directory") -> str:
    """`cause` the OSError behind `exc` (None when there is none); `kept` what is still there;
    `size` the bytes such a write takes (0: unknown); `on` which rank, `room` how to make room."""
    code = getattr(cause, "errno", None)
    reason = getattr(cause, "strerror", None) or first_line(cause or exc)
    free = free_bytes(directory)
    # torch's zip writer reports a write cut short by a full disk as "unexpected pos": no errno
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < max(size, SMALL_DISK)):
        reason = reason if code is not None else "a write was cut short"
        need = f"; it takes {amount(size)}" if size else ""
        return f"the disk is full ({reason}{on}; {amount(free)} free{need}); {kept}: free space or {room}"
    if code == errno.EFBIG:
        return f"a file exceeds the size limit ({reason}{on}; see `ulimit -f`); {kept}: raise the limit"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return f"cannot write there ({reason}{on}); {kept}: choose a writable directory"
    return f"writing failed ({type(cause or exc).__name__}: {reason}{on}); {kept}"


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def first_line(exc: BaseException | None) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def amount(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def free_bytes(directory: Path) -> int:
    for path in (directory, *directory.parents):  # the directory may not exist yet
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return 0
