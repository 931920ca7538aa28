"""Sliding-window and chunked attention on one GPU: cpctl's engine against the references.

cpctl computes windows by skipping the K/V blocks a window hides and splitting the cut ones
into fused-kernel tiles plus small explicitly masked ones. This script checks that on CUDA
(bf16 and fp32, against SDPA with the explicit boolean mask) and times it, side by side in
one run, against dense causal SDPA (what a model that ignored its window would cost) and
the flash kernel's own window (`window_size_left`, the fastest exact reference PyTorch has).
One GPU suffices: the engine runs on a CP group of one (two head-tail chunks, so every
partial-block path is taken).

    PYTHONPATH=. python scripts/bench_windows.py --out docs/benchmarks/windows_h200.jsonl

Each JSON line: kind (check | time), case, seq, window/chunk, and max abs errors or ms
(median of --steps fwd+bwd after --warmup, CUDA events) and peak GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpctl.attention import ChunkLayout, context_parallel_attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32768,131072")
    p.add_argument("--windows", default="1024,4096,8192")
    p.add_argument("--chunk", type=int, default=8192, help="a Llama 4 style attention chunk to time too")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def reference_mask(n, *, window=None, chunk=None, device):
    q, k = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    if chunk is not None:
        allowed &= k // chunk == q // chunk
    return allowed


class FlashWindow(torch.autograd.Function):
    """The flash kernel's own causal sliding window, (B, H, S, D) in and out."""

    @staticmethod
    def forward(ctx, q, k, v, window):
        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q_, k_, v_, None, None, q_.shape[1], k_.shape[1], 0.0, True, False,
            window_size_left=window - 1, window_size_right=0)
        ctx.save_for_backward(q_, k_, v_, out, lse, rng, unused)
        ctx.window = window
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q_, k_, v_, out, lse, rng, unused = ctx.saved_tensors
        no_offsets = torch.empty(0, dtype=torch.int32, device=q_.device)  # not variable-length
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.transpose(1, 2).contiguous(), q_, k_, v_, out, lse, no_offsets, no_offsets, q_.shape[1], k_.shape[1],
            0.0, True,
            rng, unused, window_size_left=ctx.window - 1, window_size_right=0)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


def cpctl_attention(q, k, v, *, window=None, chunk=None):
    layout = ChunkLayout(cp_size=1, cp_rank=0, load_balance=True)
    return context_parallel_attention(q, k, v, group=dist.group.WORLD, layout=layout, is_causal=True,
                                      enable_gqa=q.shape[1] != k.shape[1], window=window, chunk=chunk)


def inputs(args, seq, dtype, *, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_q, shape_kv = (1, args.heads, seq, args.head_dim), (1, args.kv_heads, seq, args.head_dim)

    def rand(shape):  # (B, S, H, D) memory, as projections produce it
        b, h, s, d = shape
        return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)

    return rand(shape_q), rand(shape_kv), rand(shape_kv), rand(shape_q)


def check(args, emit):
    """Engine vs SDPA with the explicit mask (fp32 reference), at 4096 tokens."""
    seq = 4096
    for dtype in (torch.float32, torch.bfloat16):
        for window, chunk in ((1, None), (300, None), (1000, None), (2500, None), (None, 700), (None, 2048), (500, 1500)):
            q, k, v, dout = inputs(args, seq, dtype, seed=1)
            ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out_ref = F.scaled_dot_product_attention(*ref, attn_mask=reference_mask(seq, window=window, chunk=chunk,
                                                                                   device="cuda"), enable_gqa=True)
            out_ref.backward(dout.float())
            mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = cpctl_attention(*mine, window=window, chunk=chunk)
            out.backward(dout)
            errors = {name: (got.float() - want).abs().max().item() for name, got, want in
                      zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine)), (out_ref, *(t.grad for t in ref)))}
            emit({"kind": "check", "dtype": str(dtype).removeprefix("torch."), "seq": seq, "window": window,
                  "chunk": chunk, "errors": errors})


def timed(step, args) -> tuple[float, float]:
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def bench(args, emit):
    for seq in (int(s) for s in args.seqs.split(",")):
        q, k, v, dout = inputs(args, seq, torch.bfloat16)

        def run(fn):
            def step():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                fn(*leaves).backward(dout)
            return step

        cases = [("sdpa_dense_causal", None, None,
                  lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True))]
        for window in (int(w) for w in args.windows.split(",")):
            cases.append(("cpctl_window", window, None, lambda a, b, c, w=window: cpctl_attention(a, b, c, window=w)))
            groups = args.heads // args.kv_heads
            cases.append(("flash_window", window, None, lambda a, b, c, w=window, g=groups: FlashWindow.apply(
                a, b.repeat_interleave(g, dim=1), c.repeat_interleave(g, dim=1), w)))
        cases.append(("cpctl_chunked", None, args.chunk, lambda a, b, c: cpctl_attention(a, b, c, chunk=args.chunk)))
        for name, window, chunk, fn in cases:
            try:
                ms, peak = timed(run(fn), args)
                emit({"kind": "time", "case": name, "seq": seq, "window": window, "chunk": chunk, "ms": round(ms, 2),
                      "peak_gib": round(peak, 2)})
            except Exception as exc:  # noqa: BLE001 - a reference kernel missing here is reported, not fatal
                emit({"kind": "time", "case": name, "seq": seq, "window": window, "chunk": chunk,
                      "error": str(exc).splitlines()[0][:200]})
            torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    meta = {"kind": "meta", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out = open(args.out, "a") if args.out else None

    def emit(record):
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")

    emit(meta)
    check(args, emit)
    bench(args, emit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
