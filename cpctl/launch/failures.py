"""Naming how a worker died when it could not say so itself: the kernel's out-of-memory killer.

A worker killed by SIGKILL leaves no report. When host memory runs out, the kernel's
out-of-memory killer is the usual sender, and long-sequence training has its own ways to fill
host memory: offloaded activations (memory.offload_activations) and FSDP's CPU offload
(memory.cpu_offload). The launcher notes the kernel's OOM-kill counters when it starts
(/proc/vmstat, and its cgroup's: v2 memory.events, v1 memory.oom_control) and samples each local
worker's resident memory once a second, so a worker's SIGKILL reads as one line: by the OOM
killer or not, how much memory the worker held, what in the profile puts tensors in host memory,
and `cpctl plan --host-memory` to size it. Torch-free; Linux files only, silently absent elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GiB = 2**30


def oom_kills() -> int | None:
    """The kernel's OOM kills so far, as this machine and this process's cgroup count them (the
    larger: a cgroup's limit kills count there, and on older kernels not in /proc/vmstat)."""
    counts = [count for count in (_vmstat_oom_kills(), _cgroup_oom_kills()) if count is not None]
    return max(counts) if counts else None


def _vmstat_oom_kills() -> int | None:
    return _field(Path("/proc/vmstat"), "oom_kill")


def _cgroup_oom_kills() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                return _field(Path(f"/sys/fs/cgroup{path}") / "memory.events", "oom_kill")
            if "memory" in controllers.split(","):  # v1
                return _field(Path(f"/sys/fs/cgroup/memory{path}") / "memory.oom_control", "oom_kill")
    return None


def _field(path: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return None


def host_memory_bytes() -> int | None:
    """MemTotal of this machine."""
    value = _field_kib(Path("/proc/meminfo"), "MemTotal:")
    return None if value is None else value * 1024


def machine_host_memory_gib() -> float | None:
    """This machine's memory for `cpctl plan`: MemTotal, or a smaller cgroup limit (a container's)."""
    total = host_memory_bytes()
    limit = _cgroup_limit()
    found = [value for value in (total, limit) if value]
    return min(found) / GiB if found else None


def _cgroup_limit() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                text = (Path(f"/sys/fs/cgroup{path}") / "memory.max").read_text().strip()
                return None if text == "max" else int(text)
            if "memory" in controllers.split(","):
                value = int((Path(f"/sys/fs/cgroup/memory{path}") / "memory.limit_in_bytes").read_text())
                return value if value < 2**60 else None  # v1's "unlimited" is a huge number
    return None


def _field_kib(path: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    return None


def _children(parent: int) -> Iterable[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == parent:  # the field after the state
                    yield int(entry.name)


class MemoryWatch:
    """For one launch: the OOM-kill counter at its start and each local worker's largest resident
    memory seen (sampled every `interval` seconds from a background thread)."""

    def __init__(self, *, interval: float = 1.0) -> None:
        self.interval = interval
        self.oom_kills_at_start = oom_kills()
        self.resident: dict[int, int] = {}  # worker pid -> largest RSS seen, bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpctl-memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        for pid in _children(os.getpid()):
            rss = _field_kib(Path(f"/proc/{pid}/status"), "VmRSS:")
            if rss is not None:
                self.resident[pid] = max(self.resident.get(pid, 0), rss * 1024)

    def killed_by(self, signal_name: str, *, pid: int, memory: Any) -> str:
        """How a worker that died of `signal_name` was killed, in words (after "was killed by")."""
        oom_now = oom_kills()
        oom = None if oom_now is None or self.oom_kills_at_start is None else oom_now > self.oom_kills_at_start
        return describe_kill(signal_name, oom=oom, resident=self.resident.get(pid), host=host_memory_bytes(),
                             offload=host_memory_options(memory))


def host_memory_options(memory: Any) -> list[str]:
    """The profile's options that keep tensors in host memory, as `key: value`."""
    names = ("offload_activations", "cpu_offload")
    return [f"memory.{name}: true" for name in names if getattr(memory, name, False)]


def describe_kill(signal_name: str, *, oom: bool | None, resident: int | None, host: int | None,
                  offload: list[str]) -> str:
    """`SIGKILL (signal 9) ...`: a SIGKILL named as the OOM killer's when the kernel counted one
    since the launch (`oom`), and what to do about host memory; other signals as they are."""
    number = getattr(signal.Signals, signal_name, None)
    shown = f"{signal_name} (signal {int(number)})" if number is not None else signal_name
    if signal_name != "SIGKILL":
        return shown
    held = f"it held {resident / GiB:.1f} GiB" if resident else "its memory use was not seen"
    machine = f" of this machine's {host / GiB:.1f} GiB" if host else ""
    plan = f"`cpctl plan --model ... --seq-len ... --host-memory {host / GiB:.0f}`" if host else \
        "`cpctl plan --host-memory GIB`"
    if oom:
        options = (f"{' and '.join(offload)} keep{'s' if len(offload) == 1 else ''} tensors in host memory; "
                   if offload else "")
        return (f"{shown} from the kernel's out-of-memory killer: host memory ran out ({held}{machine}); "
                f"{options}{plan} shows what a step needs: use more GPUs (--cp-size), shorter sequences"
                f"{', or turn the offload off' if offload else ', or fewer processes per machine'}")
    if oom is False:
        return (f"{shown}, not by this machine's out-of-memory killer (it counted no kill since the launch; "
                f"{held}): by another process or a scheduler")
    return f"{shown} ({held}{machine}; if host memory ran out, the kernel's out-of-memory killer does this: see dmesg)"
