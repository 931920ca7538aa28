"""Attention fwd+bwd, side by side: one-GPU SDPA, PyTorch native context_parallel, cpctl's ring,
Ulysses and 2D (Ulysses x ring).

Every engine runs in the same process group, on the same GPUs, in one run, so the numbers
compare like with like. Measured on 2 x H200 (device kind nvidia-h200-x2) with:

    torchrun --standalone --nproc-per-node 2 scripts/bench_attention.py \
        --out docs/benchmarks/attention_h200x2.jsonl

Engines: `cpctl` is the ring (cp = world, both strategies); `ulysses` is sp = world (one
all-to-all each way, the whole sequence on 1/sp of the heads); `2d` is sp = --sp-size x
cp = world / sp over the ring (needs a world of 4 or more). On one GPU, `--emulate N` times
one rank's local part of an N-way run instead (`ring-local`: a cp-N rank's blocks, every
K/V block taken from local memory; `ulysses-local`: attention over the whole sequence for
heads / N heads, with the all-to-all's packing copies through a 1-rank group), e.g.

    python scripts/bench_attention.py --emulate 8 --engines single,ring-local,ulysses-local \
        --seqs 32k,64k,128k

On CPU (gloo, fp32) everything runs at tiny sizes, for CI and for trying it:

    torchrun --standalone --nproc-per-node 2 scripts/bench_attention.py --seqs 256,512 \
        --engines single,cpctl,ulysses --heads 4 --head-dim 16 --steps 2

(or `cpctl launch --nproc-per-node 2 --cp-size 2 scripts/bench_attention.py ...`). Each
measurement is one JSON line: engine (single | native | cpctl), strategy, world, seq, ms
(median over steps of the slowest rank's fwd+bwd, CUDA events), tflops_per_gpu (causal
counts half the scores; backward counts 2.5x forward) and peak_gib (per GPU, with each rank
holding only its shard of q/k/v/grad_out, as in a real training step).
`scripts/plot_benchmarks.py` renders the plot from the JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpctl.attention import ChunkLayout, context_parallel_attention
from cpctl.attention import kernels as cp_kernels
from cpctl.attention import ring as ring_strategy
from cpctl.attention.blocks import ChunkSink, ForwardAccumulator, backward_blocks, forward_blocks, seq_chunks
from cpctl.attention.masks import Mask
from cpctl.attention.spec import AttentionSpec
from cpctl.attention.ulysses import ulysses_attention

LENGTHS = {f"{n}k": n * 1024 for n in (32, 64, 128, 256, 512, 1024)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32k,64k,128k,256k,512k",
                   help="comma list from " + ",".join(LENGTHS) + ", or token counts (256,512 on CPU)")
    p.add_argument("--single-max", default="256k", help="longest length timed on one GPU")
    p.add_argument("--engines", default="single,native,cpctl,ulysses,2d",
                   help="single, native, cpctl (the ring), ulysses, 2d; with --emulate: ring-local, ulysses-local")
    p.add_argument("--strategies", default="allgather,alltoall")
    p.add_argument("--sp-size", type=int, default=2, help="the Ulysses degree of the 2d rows (cp = world / sp)")
    p.add_argument("--emulate", type=int, default=None,
                   help="on one process: time one rank's local part of an N-way ring or Ulysses run")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="fewer than --heads for GQA")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kernel", default=None, help="pin cpctl's CUDA kernel: cudnn | flash | efficient")
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    return p.parse_args(argv)


def tokens(label: str) -> int:
    return LENGTHS[label] if label in LENGTHS else int(label)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32  # the CPU flash kernel: fp32


def flops(args, seq: int) -> float:
    fwd = 4.0 * args.batch * args.heads * seq * seq * args.head_dim * (0.5 if args.causal else 1.0)
    return fwd * 3.5


def time_steps(step, args, group) -> float:
    """Median over steps of the slowest rank's time, in ms (CUDA events on GPUs, the wall clock on CPU)."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier(group=group)
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            step()
            elapsed = (time.perf_counter() - began) * 1e3
        slowest = torch.tensor(elapsed, device=device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times.append(slowest.item())
    return statistics.median(times)


def local_inputs(args, local_seq: int, *, seed: int, heads: int | None = None, kv_heads: int | None = None):
    """q, k, v (requiring grad) and grad_out, as (B, H, S, D) views of (B, S, H, D) memory:
    the layout a model's projections produce, which every engine is handed alike."""
    gen = torch.Generator(device=device()).manual_seed(seed)
    heads = heads or args.heads
    kv_heads = kv_heads or args.kv_heads or args.heads

    def rand(count, grad=False):
        base = torch.randn(args.batch, local_seq, count, args.head_dim, device=device(), dtype=dtype(),
                           generator=gen).requires_grad_(grad)
        return base.transpose(1, 2)

    return rand(heads, True), rand(kv_heads, True), rand(kv_heads, True), rand(heads)


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def measure(name, strategy, seq, world, args, build_step, group, records, **layout):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        step = build_step()
        ms = time_steps(step, args, group)
        peak = torch.tensor(peak_gib(), device=device())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        record = dict(engine=name, strategy=strategy, world=world, seq=seq, ms=round(ms, 2),
                      tflops_per_gpu=round(flops(args, seq) / world / (ms * 1e-3) / 1e12, 1),
                      peak_gib=round(peak.item(), 2))
    except torch.OutOfMemoryError:
        record = dict(engine=name, strategy=strategy, world=world, seq=seq, ms=None, error="out of memory")
    record.update(layout, heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                  batch=args.batch, causal=args.causal, dtype=str(dtype()).removeprefix("torch."),
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)
    records.append(record)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def single_step(args, seq):
    q, k, v, dout = local_inputs(args, seq, seed=0)
    gqa = (args.kv_heads or args.heads) != args.heads

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=gqa).backward(dout)

    return step


def cpctl_step(args, seq, strategy, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = ChunkLayout(cp_size=world, cp_rank=rank, load_balance=args.causal)
    q, k, v, dout = local_inputs(args, seq // world, seed=rank)
    gqa = (args.kv_heads or args.heads) != args.heads

    def step():
        out = context_parallel_attention(q, k, v, group=group, layout=layout, strategy=strategy,
                                         is_causal=args.causal, enable_gqa=gqa)
        out.backward(dout)

    return step


def ulysses_step(args, seq, strategy, *, sp_group, cp_group):
    """Ulysses over sp_group, the ring over cp_group (of size 1: Ulysses alone)."""
    cp, sp = dist.get_world_size(cp_group), dist.get_world_size(sp_group)
    ring = ChunkLayout(cp_size=cp, cp_rank=dist.get_rank(cp_group), load_balance=args.causal)
    q, k, v, dout = local_inputs(args, seq // (cp * sp), seed=dist.get_rank())
    gqa = (args.kv_heads or args.heads) != args.heads

    def step():
        out = ulysses_attention(q, k, v, sp_group=sp_group, cp_group=cp_group, ring_layout=ring, strategy=strategy,
                                is_causal=args.causal, enable_gqa=gqa)
        out.backward(dout)

    return step


def ring_local_step(args, seq, n: int, group):
    """One cp-n rank's compute: its blocks against every ring step's K/V, each taken from local
    memory (no transfer), forward then backward, as the ring strategy plans them."""
    layout = ChunkLayout(cp_size=n, cp_rank=0, load_balance=args.causal)
    q, k, v, dout = (t.detach() for t in local_inputs(args, seq // n, seed=0))
    c = q.shape[2] // len(layout.local_chunks)
    spec = AttentionSpec(group=group, layout=layout, mask=Mask(causal=args.causal), scale=args.head_dim ** -0.5,
                         strategy="alltoall", chunk_len=c)
    plans = [ring_strategy.plan(spec, source) for source in range(n)]

    def step():
        acc = ForwardAccumulator(q, chunk_len=c, num_chunks=len(layout.local_chunks))
        for blocks in plans:
            forward_blocks(acc, blocks, q, k, v, spec=spec)
        out, lse = acc.result(q.dtype)
        dq_buf, dkv_buf = torch.empty_like(q), torch.empty(2, *k.shape, dtype=k.dtype, device=k.device)
        for blocks in plans:
            dq = ChunkSink(seq_chunks(dq_buf, chunk_len=c), num_chunks=len(layout.local_chunks), chunk_len=c)
            dkv = ChunkSink(seq_chunks(dkv_buf[0], dkv_buf[1], chunk_len=c), num_chunks=len(layout.local_chunks),
                            chunk_len=c)
            backward_blocks(blocks, dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dkv=dkv, chunk_len=c, spec=spec)

    return step


def ulysses_local_step(args, seq, n: int, group):
    """One sp-n rank's local part: the all-to-all's packing through a 1-rank group, then attention
    over the whole sequence for heads / n heads (K/V heads replicated as the engine does)."""
    kv = args.kv_heads or args.heads
    kv_local = max(1, kv // n)
    q, k, v, dout = local_inputs(args, seq, seed=0, heads=args.heads // n, kv_heads=kv_local)
    ring = ChunkLayout(cp_size=1, cp_rank=0, load_balance=args.causal)

    def step():
        out = ulysses_attention(q, k, v, sp_group=group, cp_group=group, ring_layout=ring, is_causal=args.causal,
                                enable_gqa=q.shape[1] != k.shape[1])
        out.backward(dout)

    return step


def native_step(args, seq, strategy, mesh):
    """PyTorch's context_parallel, fed shard-sized inputs (timing does not depend on the values)."""
    from torch.distributed.tensor.experimental import context_parallel

    try:
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    except ImportError:  # moved in newer releases
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options, set_rotate_method
    set_rotate_method(strategy)
    _cp_options.enable_load_balance = args.causal
    world = mesh.size()
    q, k, v, dout = local_inputs(args, seq // world, seed=mesh.get_local_rank())
    gqa = (args.kv_heads or args.heads) != args.heads

    placeholder = torch.zeros(1, 2 * world, device="cuda")  # context_parallel wants one buffer

    def step():
        with context_parallel(mesh, buffers=[placeholder], buffer_seq_dims=[1]):
            F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=gqa).backward(dout)

    return step


def measure_all(args, world, mesh, group) -> list[dict]:
    engines = args.engines.split(",")
    strategies = args.strategies.split(",")
    single_group = dist.new_group([0])  # every rank must take part in creating it
    twod = None
    if "2d" in engines and world >= 4 and world % args.sp_size == 0 and args.sp_size > 1 and world > args.sp_size:
        twod = torch.distributed.device_mesh.init_device_mesh(
            device().type, (world // args.sp_size, args.sp_size), mesh_dim_names=("cp", "sp"))
    records: list[dict] = []
    for label in args.seqs.split(","):
        seq = tokens(label)
        if "single" in engines and seq <= tokens(args.single_max):
            if dist.get_rank() == 0:
                measure("single", None, seq, 1, args, lambda: single_step(args, seq), single_group, records)
            dist.barrier()
        if args.emulate:
            n = args.emulate
            if "ring-local" in engines:
                measure("ring-local", None, seq, n, args, lambda: ring_local_step(args, seq, n, group), group,
                        records, cp=n, sp=1)
            if "ulysses-local" in engines:
                measure("ulysses-local", None, seq, n, args, lambda: ulysses_local_step(args, seq, n, group), group,
                        records, cp=1, sp=n)
            continue
        if world == 1:
            continue
        for strategy in strategies:
            if "native" in engines and device().type == "cuda":  # PyTorch's own CP has no CPU kernel
                measure("native", strategy, seq, world, args, lambda: native_step(args, seq, strategy, mesh), group,
                        records, cp=world, sp=1)
            if "cpctl" in engines:
                measure("cpctl", strategy, seq, world, args, lambda: cpctl_step(args, seq, strategy, group), group,
                        records, cp=world, sp=1)
            if twod is not None:
                measure("2d", strategy, seq, world, args,
                        lambda: ulysses_step(args, seq, strategy, sp_group=twod["sp"].get_group(),
                                             cp_group=twod["cp"].get_group()),
                        group, records, cp=world // args.sp_size, sp=args.sp_size)
        if "ulysses" in engines:  # no ring, so no strategy
            measure("ulysses", None, seq, world, args,
                    lambda: ulysses_step(args, seq, "allgather", sp_group=group, cp_group=single_cp_group(world)),
                    group, records, cp=1, sp=world)
    return records


_single_cp_groups: dict[int, dist.ProcessGroup] = {}


def single_cp_group(world: int) -> dist.ProcessGroup:
    """Each rank alone: the cp axis of sp = world (created once, by every rank together)."""
    if world not in _single_cp_groups:
        mesh = torch.distributed.device_mesh.init_device_mesh(device().type, (world, 1), mesh_dim_names=("sp", "cp"))
        _single_cp_groups[world] = mesh["cp"].get_group()
    return _single_cp_groups[world]


def main(argv=None):
    args = parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # plain `python`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if args.emulate and world != 1:
        raise SystemExit("--emulate times one rank's local part: run it as one process (python, not torchrun)")
    mesh = torch.distributed.device_mesh.init_device_mesh(device().type, (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    with cp_kernels.pinned_kernel(args.kernel):
        records = measure_all(args, world, mesh, group)
    if dist.get_rank() == 0 and args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
