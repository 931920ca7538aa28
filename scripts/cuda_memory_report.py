"""What is allocated on the GPU at the peak of a step, from the CUDA caching allocator's own history.

`torch.cuda.max_memory_allocated` says how high a step went, not what was there. Recording the
allocator's history (every allocation and free, with the Python stack that made it) and replaying
it finds the moment of the peak and the blocks live then, including what no Python-level tracker
sees: the buffers an attention kernel allocates inside its own backward, NCCL's, the allocator's
rounding. `scripts/memory_trace_cpu.py` names tensors by module and autograd node but sees only
the tensors ops return; this sees bytes.

    with recording() as history:
        step()
    print(report(history))

`scripts/bench_train.py --memory-report PATH` records the last step it runs and writes this.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch

MiB = 2**20
# Frames inside these are how an allocation happened, not why: the first frame outside them names it.
PLUMBING = ("/torch/", "/contextlib.py", "/functools.py", "<frozen")


@dataclasses.dataclass
class History:
    """What `recording` saw: the bytes allocated when it began, and the allocator's snapshot at its end."""

    base_bytes: int
    snapshot: dict | None = None


@contextlib.contextmanager
def recording() -> Iterator[History]:
    """The allocator's history, with Python stacks, while the block runs; recording stops however it ends."""
    history = History(base_bytes=torch.cuda.memory_allocated())
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        yield history
        torch.cuda.synchronize()
        history.snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _origin(frames: list[dict]) -> str:
    """The innermost two frames outside torch (file:line function), innermost first, and the torch
    frame they called."""
    if not frames:
        return "(no Python frame: the autograd engine's C++ backward, or a kernel's own buffer)"
    names = [f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}" for frame in frames]
    ours = [index for index, frame in enumerate(frames) if not any(part in frame["filename"] for part in PLUMBING)]
    if not ours:
        return names[0]
    called = f"  [{names[ours[0] - 1]}]" if ours[0] else ""
    return " < ".join(names[index] for index in ours[:2]) + called


@dataclasses.dataclass
class Peak:
    bytes: int  # the recorded allocations' live bytes at the peak (blocks made before recording not included)
    live: list[tuple[int, str]]  # (bytes, origin) of each block live then
    events: int


def replay(snapshot: dict, *, device: int = 0) -> Peak:
    """The allocator's trace, replayed: the peak of the allocated bytes and the blocks live at it."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list[dict]]] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return Peak(bytes=peak, live=[(size, _origin(frames)) for size, frames in at_peak.values()], events=len(trace))


def report(history: History, *, top: int = 40) -> str:
    found, base_bytes = replay(history.snapshot), history.base_bytes
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for size, origin in found.live:
        groups[origin].append(size)
    lines = [(f"peak allocated: {(base_bytes + found.bytes) / 2**30:.2f} GiB = {base_bytes / 2**30:.2f} GiB allocated "
              f"before recording + {found.bytes / 2**30:.2f} GiB recorded ({found.events} allocator events)"),
             f"torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB",
             "live at the peak, largest first (MiB, count x sizes in MiB, where made):"]
    for origin, sizes in sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]:
        shown = ", ".join(f"{size / MiB:.0f}" for size in sorted(sizes, reverse=True)[:6])
        lines.append(f"  {sum(sizes) / MiB:9.1f}  {len(sizes):4d} x [{shown}{', ...' if len(sizes) > 6 else ''}]  {origin}")
    return "\n".join(lines)
