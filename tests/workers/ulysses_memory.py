"""Worker: the bytes Ulysses' backward makes and holds at its peak, for `cpctl plan`'s Ulysses term.

    torchrun --nproc-per-node 4 tests/workers/ulysses_memory.py OUT.jsonl

Each case runs one Ulysses attention (sp 4, and sp 2 twice side by side; no ring) forward, then
its backward under a tracker of the storages that ops make and that are still alive. Rank 0
writes the peak per case, beside the shapes that `cpctl plan` needs to predict it.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cpctl.attention import ChunkLayout, shard
from cpctl.attention.ulysses import sequence_layout, ulysses_attention

SP_SIZES = (4, 2)
HEADS = ((4, 4), (4, 2), (4, 1), (8, 2))
HEAD_DIM = 16


class BackwardPeak(TorchDispatchMode):
    """The peak of the bytes of live storages that ops made while it was active."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.live:
                storage = tensor.untyped_storage()
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def main():
    started_here = not dist.is_initialized()  # in tests/pool.py's processes the group is the pool's
    if started_here:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    records = []
    for sp in SP_SIZES:
        mesh = init_device_mesh("cpu", (world // sp, 1, sp), mesh_dim_names=("dp", "cp", "sp"))
        ring = ChunkLayout(cp_size=1, cp_rank=0, load_balance=False)
        layout = sequence_layout(ring, sp_size=sp, sp_rank=mesh["sp"].get_local_rank())
        for (q_heads, kv_heads), batch in [(heads, batch) for heads in HEADS for batch in (1, 2)]:
            seq = 32 * sp
            gen = torch.Generator().manual_seed(0)
            q, dout = (torch.randn(batch, q_heads, seq, HEAD_DIM, generator=gen) for _ in range(2))
            k, v = (torch.randn(batch, kv_heads, seq, HEAD_DIM, generator=gen) for _ in range(2))
            local = [shard(t, seq_dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
            out = ulysses_attention(*local, sp_group=mesh["sp"].get_group(), cp_group=mesh["cp"].get_group(),
                                    ring_layout=ring, is_causal=True, enable_gqa=kv_heads != q_heads)
            local_dout = shard(dout, seq_dim=2, layout=layout)
            with BackwardPeak() as backward:  # returned, not accumulated into leaves' .grad (a model's q is no leaf)
                torch.autograd.grad(out, local, local_dout)
            records.append(dict(sp=sp, q_heads=q_heads, kv_heads=kv_heads, head_dim=HEAD_DIM, batch=batch, seq=seq,
                                backward_peak_bytes=backward.peak))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
    dist.barrier()
    if started_here:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
