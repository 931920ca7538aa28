"""Worker: Ulysses and 2D (Ulysses x ring) attention against single-process SDPA on the full sequence.

    torchrun --nproc-per-node 4 tests/workers/ulysses_cases.py OUT.jsonl [--quick]

On CUDA (NCCL) the same cases run in bf16 against the fp32 reference, with the layouts the
world allows; the CPU test suite runs it with gloo in fp32.

Every (cp, sp) layout of the world in LAYOUTS runs every case (with --quick, the quick tier's
share: `cases(quick=True)`); with fewer sp x cp ranks than
the world, the other ranks form more groups that compute the same case side by side (the dp
axis). Rank 0 writes one JSON object per (layout, case): the max abs error of the output and
of dq/dk/dv against the reference, on the whole sequence.
"""

import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cases import document_rows, reference_mask

from cpctl.attention import ChunkLayout, Strategy, shard, unshard
from cpctl.attention.ulysses import sequence_layout, ulysses_attention
from cpctl.runtime.documents import place

STRATEGIES = tuple(strategy.value for strategy in Strategy)
# (cp, sp) at world 4; must match tests/test_ulysses.py
LAYOUTS = ((1, 4), (2, 2), (1, 2))
HEADS = ((4, 4), (4, 2), (4, 1), (8, 2))
EXTRAS = [dict(window=w) for w in (1, 7, 24, 1000)] + [dict(chunk=c) for c in (5, 24)]
EXTRAS += [dict(window=10, chunk=24), dict(v_dim=8), dict(v_dim=24), dict(dtype="float64")]
EXTRAS += [dict(documents=d) for d in ("one_token", "spanning", "many_short", "whole", "mixed_rows")]
EXTRAS += [dict(documents="spanning", window=6)]
# under autocast, q from RoPE in fp32 and k/v in bf16, as a bf16 model's SDPA call gets them
EXTRAS += [dict(dtype="autocast")]


def cases(cp: int, *, quick: bool = False):
    """Plain cases over heads (GQA/MQA with fewer K/V heads than sp ranks), then the masks and
    dtypes; each strategy where there is a ring (cp > 1). `quick`: the quick tier's quarter, every
    head layout, mask, dtype and strategy, balanced, in batches of 2, the masks and dtypes causal."""
    strategies = STRATEGIES if cp > 1 else STRATEGIES[:1]
    for strategy, causal, load_balance, (q_heads, kv_heads), batch in itertools.product(
            strategies, (True, False), (True, False), HEADS, (1, 2)):
        if not quick or (load_balance and batch == 2):
            yield dict(strategy=strategy, causal=causal, load_balance=load_balance, q_heads=q_heads, kv_heads=kv_heads,
                       batch=batch)
    for strategy, causal, load_balance, extra in itertools.product(strategies, (True, False), (True, False), EXTRAS):
        if not quick or (load_balance and causal):
            yield dict(strategy=strategy, causal=causal, load_balance=load_balance, q_heads=4, kv_heads=2, batch=2,
                       **extra)


def run_case(*, mesh, seq_mesh, strategy, causal, load_balance, q_heads, kv_heads, batch, dtype="float32", window=None,
             chunk=None, v_dim=None, documents=None):
    cp_mesh, sp_mesh = mesh["cp"], mesh["sp"]
    cp, sp = cp_mesh.size(), sp_mesh.size()
    seq = 32 * cp * sp
    ring = ChunkLayout(cp_size=cp, cp_rank=cp_mesh.get_local_rank(), load_balance=load_balance)
    if documents is not None:
        documents = document_rows(documents, seq, batch)
        if load_balance:  # the cost-balanced ring layout the runtime would pick
            ring = place(documents, seq_len=seq, cp_size=cp, cp_rank=cp_mesh.get_local_rank(), pieces=sp).layout
    layout = sequence_layout(ring, sp_size=sp, sp_rank=sp_mesh.get_local_rank())
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    autocast = dtype == "autocast"
    dtype = torch.bfloat16 if (on_cuda and dtype == "float32") or autocast else getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1234)
    head_dim, v_dim = (64, v_dim and v_dim * 4 or 64) if on_cuda else (16, v_dim or 16)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, dout = rand(batch, q_heads, seq, head_dim), rand(batch, q_heads, seq, v_dim)
    k, v = rand(batch, kv_heads, seq, head_dim), rand(batch, kv_heads, seq, v_dim)
    ref_dtype = torch.promote_types(dtype, torch.float32)
    ref_inputs = [t.detach().to(ref_dtype).clone().requires_grad_() for t in (q, k, v)]
    mask = reference_mask(seq, causal=causal, window=window, chunk=chunk, documents=documents, device=q.device)
    ref = F.scaled_dot_product_attention(*ref_inputs, attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=kv_heads != q_heads)
    ref.backward(dout.to(ref_dtype))

    local = [shard(t, seq_dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
    if autocast:
        local[0] = local[0].detach().float().requires_grad_()
    saved = {}  # what autograd keeps for backward, by storage: cpctl plan's Ulysses terms count it per token

    def pack(tensor):
        saved[(tensor.untyped_storage().data_ptr(), tensor.device)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = ulysses_attention(*local, sp_group=sp_mesh.get_group(), cp_group=cp_mesh.get_group(), ring_layout=ring,
                                strategy=strategy, is_causal=causal, enable_gqa=kv_heads != q_heads, window=window,
                                chunk=chunk, documents=documents)
    out.backward(shard(dout, seq_dim=2, layout=layout))

    def full(local_tensor):
        pieces = [torch.empty_like(local_tensor) for _ in range(cp * sp)]
        dist.all_gather(pieces, local_tensor.contiguous(), group=seq_mesh.get_group())
        return unshard(pieces, seq_dim=2, layout=layout)

    results = {"out": full(out.detach()), **{f"d{n}": full(t.grad) for n, t in zip("qkv", local)}}
    expected = {"out": ref.detach(), "dq": ref_inputs[0].grad, "dk": ref_inputs[1].grad, "dv": ref_inputs[2].grad}
    errors = {name: (results[name].to(ref_dtype) - expected[name]).abs().max().item() for name in expected}
    if autocast:  # bf16 rounding grows with the values: relative to the largest
        errors = {name: error / expected[name].abs().max().item() for name, error in errors.items()}
    return seq, errors, sum(saved.values())


def main():
    output, quick = sys.argv[1], "--quick" in sys.argv[2:]
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    started_here = not dist.is_initialized()  # in tests/pool.py's processes the group is the pool's
    if started_here:
        dist.init_process_group("nccl" if on_cuda else "gloo")
    world = dist.get_world_size()
    records = []
    for cp, sp in LAYOUTS if not on_cuda else [(c, s) for c, s in ((1, world), (2, world // 2)) if c * s == world]:
        mesh = init_device_mesh("cuda" if on_cuda else "cpu", (world // (cp * sp), cp, sp),
                                mesh_dim_names=("dp", "cp", "sp"))
        seq_mesh = mesh["cp", "sp"]._flatten("seq")  # the ranks that split one sequence, cp-major
        for case in cases(cp, quick=quick):
            if on_cuda and case.get("dtype") == "float64":
                continue
            seq, errors, saved_bytes = run_case(mesh=mesh, seq_mesh=seq_mesh, **case)
            records.append(dict(world=world, cp=cp, sp=sp, seq=seq, **case, errors=errors, saved_bytes=saved_bytes))
    if dist.get_rank() == 0:
        Path(output).write_text("".join(json.dumps(record) + "\n" for record in records))
    # every rank done before any tears gloo down: a rank leaving first aborts its peers' pending pair threads
    dist.barrier()
    if started_here:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
