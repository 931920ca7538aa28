"""Host memory for offloaded activations, at the exact size of what is offloaded.

PyTorch's pinned allocator (`torch.empty(..., pin_memory=True)`, `save_on_cpu`) rounds every
block up to a power of two: a 2.25 GiB block input takes 4 GiB, and the Llama-3.2-3B shape at
384k tokens asked for 112 GiB of host memory where its tensors were 84 GiB. Here each
offloaded tensor gets a buffer of exactly its size: plain CPU memory, registered with CUDA
(`cudaHostRegister`) so copies to and from the GPU stay asynchronous. A buffer goes back to
the arena when autograd drops what it saved (after that tensor's backward) and is taken again
by the next step's tensor of the same size, so after the first step nothing is allocated or
registered any more and the host footprint is the most the step holds at once.

On CPU (tests, CI) the same code runs without registration: tensors are copied into the
arena's buffers and back, so the bookkeeping (sizes, reuse, exactness) is what a GPU run does.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from cpctl.errors import CpctlError
from cpctl.planner.units import GiB

# Left to the rest of the machine when a new buffer is checked against MemAvailable: the
# other processes of the node, the page cache the system needs to keep running.
HOST_RESERVE_BYTES = 2 * GiB


class _Buffer:
    """One host allocation of exactly `nbytes`, registered with CUDA when `pin`."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin:
            code = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0))
            if code != 0:
                raise CpctlError(f"memory.offload_activations: cannot pin {nbytes / GiB:.2f} GiB of host memory "
                                 f"(cudaHostRegister error {code}); free host memory, use more GPUs (--cp-size), "
                                 "or set offload_activations: false")
            self.pinned = True

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        self.data = torch.empty(0, dtype=torch.uint8)


class _Slot:
    """A buffer in use: returned to its arena when the last handle on it is dropped."""

    def __init__(self, arena: HostArena, buffer: _Buffer) -> None:
        self.buffer = buffer
        self._finalizer = weakref.finalize(self, arena._give_back, buffer)


@dataclass(frozen=True)
class Packed:
    """What autograd keeps instead of a saved tensor: where its bytes are on the host."""

    slot: _Slot
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    requires_grad: bool

    def tensor(self) -> torch.Tensor:
        """The host bytes as a tensor of the saved dtype and shape (a view of the arena's buffer)."""
        count = self.slot.buffer.nbytes
        return self.slot.buffer.data[:count].view(self.dtype).view(self.shape)


class HostArena:
    """Exact-size host buffers for the tensors of one device, reused across steps.

    `pin`: register the buffers with CUDA (the default on a CUDA device). Counters:
    `allocated_bytes` (held now, in use or free), `peak_bytes` (the most ever held),
    `in_use_bytes`, `allocations` (buffers created since the start).
    """

    def __init__(self, device: torch.device, *, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._free: dict[int, list[_Buffer]] = {}
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        # Tensors packed while still alive and unchanged: a second save of the same memory (an
        # RMSNorm's fp32 input, saved by its pow and by its mul; attention's output, saved by
        # attention and recorded by the selective level) shares the first one's buffer.
        self._packed: dict[tuple, tuple[weakref.ref, int, weakref.ref]] = {}

    # ------------------------------------------------------------------ buffers

    def _take(self, nbytes: int) -> _Buffer:
        free = self._free.get(nbytes)
        if free:
            buffer = free.pop()
        else:
            if any(self._free.values()):
                # A size not seen before (another sequence length): what is free is of sizes the new
                # steps will not ask for. Released before the new buffer is made, not after.
                self.trim()
            self._check_host_memory(nbytes)
            buffer = _Buffer(nbytes, pin=self.pin)
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.allocations += 1
        self.in_use_bytes += nbytes
        return buffer

    def _give_back(self, buffer: _Buffer) -> None:
        self.in_use_bytes -= buffer.nbytes
        self._free.setdefault(buffer.nbytes, []).append(buffer)

    def trim(self) -> None:
        """Release the buffers no saved tensor uses now."""
        if self.pin and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)  # no copy from a buffer may still be in flight
        for buffers in self._free.values():
            for buffer in buffers:
                self.allocated_bytes -= buffer.nbytes
                buffer.release()
        self._free.clear()

    def _check_host_memory(self, nbytes: int) -> None:
        """A clear error instead of the kernel's out-of-memory killer, when the machine says so."""
        available = available_host_bytes()
        if available is not None and nbytes > available - HOST_RESERVE_BYTES:
            raise CpctlError(
                f"memory.offload_activations: the step needs {nbytes / GiB:.2f} GiB more host memory for offloaded "
                f"activations ({self.allocated_bytes / GiB:.1f} GiB taken already) but this machine has "
                f"{max(available, 0) / GiB:.1f} GiB available; `cpctl plan --host-memory GIB` shows what a step "
                "needs: shorten the sequence, use more GPUs (--cp-size), or set offload_activations: false")

    # ------------------------------------------------------------------ saved tensors

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | Packed:
        """The hook autograd calls for each tensor it saves: its bytes go to a host buffer."""
        if (tensor.device != self.device or tensor.layout != torch.strided or tensor.numel() == 0
                or isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)):
            # Parameters (and views of them: a Linear saves its weight transposed) stay where their
            # module keeps them; FSDP gathers them again for backward.
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        known = self._packed.get(key)
        if known is not None:
            owner, version, slot_ref = known
            slot = slot_ref()
            # While the tensor that was packed lives, its memory is its own, and an alias of it shares
            # its version counter: same key, same version, same bytes.
            if owner() is not None and tensor._version == version and slot is not None:
                return Packed(slot, tensor.dtype, tensor.shape, tensor.device, tensor.requires_grad)
        slot = _Slot(self, self._take(tensor.numel() * tensor.element_size()))
        packed = Packed(slot, tensor.dtype, tensor.shape, tensor.device, tensor.requires_grad)
        packed.tensor().copy_(tensor, non_blocking=self.pin)
        with contextlib.suppress(TypeError):  # a tensor subclass without weak references is not shared
            owner = weakref.ref(tensor, lambda dead, key=key: self._forget(key, dead))
            self._packed[key] = (owner, tensor._version, weakref.ref(slot))
        return packed

    def _forget(self, key: tuple, dead: weakref.ref) -> None:
        entry = self._packed.get(key)
        if entry is not None and entry[0] is dead:
            del self._packed[key]

    def unpack(self, packed: torch.Tensor | Packed) -> torch.Tensor:
        """The saved tensor again, on its device (a copy: the buffer stays the arena's)."""
        if not isinstance(packed, Packed):
            return packed
        host = packed.tensor()
        if self.device.type == "cpu":
            return host.clone()
        return host.to(packed.device, non_blocking=self.pin)

    def saved_tensors(self) -> saved_tensors_hooks:
        """Inside, what autograd saves goes to this arena."""
        return saved_tensors_hooks(self.pack, self.unpack)


def available_host_bytes() -> int | None:
    """MemAvailable (Linux), lowered to the cgroup's limit when a container sets one; None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    in_cgroup = _cgroup_available()
    return available if in_cgroup is None else min(available, in_cgroup)


def _cgroup_available() -> int | None:
    """What this process's cgroup v2 still allows (memory.max less what is in use and not easily
    reclaimed), or None without a limit."""
    try:
        with open("/proc/self/cgroup") as cgroup:
            path = next(line.split(":", 2)[2].strip() for line in cgroup if line.startswith("0::"))
        base = f"/sys/fs/cgroup{path}".rstrip("/")
        with open(f"{base}/memory.max") as limit_file:
            limit = limit_file.read().strip()
        if limit == "max":
            return None
        with open(f"{base}/memory.current") as current_file:
            current = int(current_file.read().strip())
        with open(f"{base}/memory.stat") as stat_file:
            stat = dict(line.split() for line in stat_file if line.count(" ") == 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return int(limit) - current + int(stat.get("inactive_file", 0))


def offload_saved_activations(model: nn.Module, *, arena: HostArena) -> None:
    """Everything autograd saves during the model's forward goes to `arena` and comes back for
    backward; with activation checkpointing that is the block inputs, the bulk of what a long
    sequence keeps between forward and backward.

    The hooks are entered by a forward pre-hook and left by a forward hook that runs also when
    the forward raises (`always_call`): a failed step leaves nothing pushed, so later steps and
    code outside the model save their tensors as usual.
    """
    entered: list[saved_tensors_hooks] = []

    def enter(module: nn.Module, args: object) -> None:
        hooks = arena.saved_tensors()
        hooks.__enter__()
        entered.append(hooks)

    def leave(module: nn.Module, args: object, output: object) -> None:
        if entered:  # not entered when a pre-hook before ours raised
            entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
