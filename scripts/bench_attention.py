"""Attention fwd+bwd, side by side: one-GPU SDPA, PyTorch native context_parallel, cpctl.

Every engine runs in the same process group, on the same GPUs, in one run, so the numbers
compare like with like. Measured on 2 x H200 (device kind nvidia-h200-x2) with:

    torchrun --standalone --nproc-per-node 2 scripts/bench_attention.py \
        --out docs/benchmarks/attention_h200x2.jsonl

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

LENGTHS = {f"{n}k": n * 1024 for n in (32, 64, 128, 256, 512, 1024)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32k,64k,128k,256k,512k", help="comma list from " + ",".join(LENGTHS))
    p.add_argument("--single-max", default="256k", help="longest length timed on one GPU")
    p.add_argument("--engines", default="single,native,cpctl")
    p.add_argument("--strategies", default="allgather,alltoall")
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


def flops(args, seq: int) -> float:
    fwd = 4.0 * args.batch * args.heads * seq * seq * args.head_dim * (0.5 if args.causal else 1.0)
    return fwd * 3.5


def time_steps(step, args, group) -> float:
    """Median over steps of the slowest rank's time, in ms."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        slowest = torch.tensor(start.elapsed_time(end), device="cuda")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times.append(slowest.item())
    return statistics.median(times)


def local_inputs(args, local_seq: int, *, seed: int):
    """q, k, v (requiring grad) and grad_out, as (B, H, S, D) views of (B, S, H, D) memory:
    the layout a model's projections produce, which every engine is handed alike."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads = args.kv_heads or args.heads

    def rand(heads, grad=False):
        base = torch.randn(args.batch, local_seq, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_(grad)
        return base.transpose(1, 2)

    return rand(args.heads, True), rand(kv_heads, True), rand(kv_heads, True), rand(args.heads)


def measure(name, strategy, seq, world, args, build_step, group, records):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        step = build_step()
        ms = time_steps(step, args, group)
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        record = dict(engine=name, strategy=strategy, world=world, seq=seq, ms=round(ms, 2),
                      tflops_per_gpu=round(flops(args, seq) / world / (ms * 1e-3) / 1e12, 1),
                      peak_gib=round(peak.item(), 2))
    except torch.OutOfMemoryError:
        record = dict(engine=name, strategy=strategy, world=world, seq=seq, ms=None, error="out of memory")
    record.update(heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                  batch=args.batch, causal=args.causal, gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)
    records.append(record)
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
    records: list[dict] = []
    for label in args.seqs.split(","):
        seq = LENGTHS[label]
        if "single" in engines and seq <= LENGTHS[args.single_max]:
            if dist.get_rank() == 0:
                measure("single", None, seq, 1, args, lambda: single_step(args, seq), single_group, records)
            dist.barrier()
        if world == 1:
            continue
        for strategy in strategies:
            if "native" in engines:
                measure("native", strategy, seq, world, args, lambda: native_step(args, seq, strategy, mesh), group, records)
            if "cpctl" in engines:
                measure("cpctl", strategy, seq, world, args, lambda: cpctl_step(args, seq, strategy, group), group, records)
    return records


def main(argv=None):
    args = parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
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
