"""Masked attention on one GPU (windows, attention chunks, packed documents): cpctl's engine
against what a model would otherwise run.

cpctl skips the K/V blocks a mask hides and computes the ones it cuts with fused kernels
(a windowed flash call for a sliding window's band on CUDA, tiles elsewhere). This script
checks that on CUDA (fp32 and bf16, against SDPA with the explicit boolean mask) and times
it, side by side in one run, against dense causal SDPA (what a model that ignored its mask
would cost) and SDPA with the boolean mask transformers would build (at lengths where that
S x S mask fits). One GPU suffices: the engine runs on a CP group of one, two head-tail
chunks, which is the kernel path a CP rank runs.

    PYTHONPATH=. python scripts/bench_masks.py --out docs/benchmarks/masks_h200.jsonl

Each JSON line: kind (check | time), case, seq, window / chunk / documents, and max abs
errors, or ms (median of --steps fwd+bwd after --warmup, CUDA events) and peak GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpctl.attention import ChunkLayout, context_parallel_attention
from cpctl.runtime.documents import starts_per_row
from cpctl.runtime.data import position_ids_for_documents


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32768,131072")
    p.add_argument("--windows", default="1024,4096,8192")
    p.add_argument("--chunk", type=int, default=8192, help="a Llama 4 style attention chunk to time too")
    p.add_argument("--masked-max", type=int, default=32768, help="longest length timed with SDPA and a boolean mask")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a quick smoke run of the same code")
    p.add_argument("--check-seq", type=int, default=4096)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def reference_mask(n, *, window=None, chunk=None, documents=None, device):
    q, k = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    if chunk is not None:
        allowed &= k // chunk == q // chunk
    if documents is not None:
        starts = torch.tensor(documents, device=device)
        doc = torch.searchsorted(starts, torch.arange(n, device=device), right=True)
        allowed &= doc[:, None] == doc[None, :]
    return allowed


def long_tailed_documents(seq: int, *, seed: int = 0) -> tuple[int, ...]:
    """Document starts for lengths drawn log-normally (median ~1.8k tokens, a long tail)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        length = int(torch.exp(7.5 + 1.2 * torch.randn((), generator=gen)).item()) + 1
        length = min(length, seq - total)
        lengths.append(length)
        total += length
    return starts_per_row(position_ids_for_documents(lengths))[0]


def cpctl_attention(q, k, v, *, window=None, chunk=None, documents=None):
    layout = ChunkLayout(cp_size=1, cp_rank=0, load_balance=True)
    return context_parallel_attention(q, k, v, group=dist.group.WORLD, layout=layout, is_causal=True,
                                      enable_gqa=q.shape[1] != k.shape[1], window=window, chunk=chunk,
                                      documents=None if documents is None else [documents])


def inputs(args, seq, dtype, *, seed=0):
    gen = torch.Generator(device=args.device).manual_seed(seed)
    shape_q, shape_kv = (1, args.heads, seq, args.head_dim), (1, args.kv_heads, seq, args.head_dim)

    def rand(shape):  # (B, S, H, D) memory, as projections produce it
        b, h, s, d = shape
        return torch.randn(b, s, h, d, device=args.device, dtype=dtype, generator=gen).transpose(1, 2)

    return rand(shape_q), rand(shape_kv), rand(shape_kv), rand(shape_q)


def check(args, emit):
    """Engine vs SDPA with the explicit mask (fp32 reference), at --check-seq tokens."""
    seq = args.check_seq
    for dtype in (torch.float32, torch.bfloat16) if args.device == "cuda" else (torch.float32,):
        cases = [(1, None, None), (300, None, None), (1000, None, None), (2500, None, None), (None, 700, None),
                 (None, 2048, None), (500, 1500, None), (None, None, long_tailed_documents(seq, seed=3)),
                 (None, None, tuple(sorted({0, 1, 2, seq // 4, seq // 2 - 1, seq // 2, seq // 2 + 1, seq - 5}))),
                 (seq // 6, None, (0, seq // 3, seq // 3 + 100))]
        for window, chunk, documents in cases:
            q, k, v, dout = inputs(args, seq, dtype, seed=1)
            ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
            allowed = reference_mask(seq, window=window, chunk=chunk, documents=documents, device=args.device)
            out_ref = F.scaled_dot_product_attention(*ref, attn_mask=allowed, enable_gqa=True)
            out_ref.backward(dout.float())
            mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = cpctl_attention(*mine, window=window, chunk=chunk, documents=documents)
            out.backward(dout)
            errors = {name: (got.float() - want).abs().max().item() for name, got, want in
                      zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine)), (out_ref, *(t.grad for t in ref)))}
            record = {"kind": "check", "dtype": str(dtype).removeprefix("torch."), "seq": seq, "window": window,
                      "chunk": chunk, "documents": None if documents is None else len(documents), "errors": errors}
            if dtype == torch.bfloat16:  # the bar is SDPA's own bf16 error: measure it beside
                same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                sdpa = F.scaled_dot_product_attention(*same, attn_mask=allowed, enable_gqa=True)
                sdpa.backward(dout)
                record["sdpa_bf16_errors"] = {name: (got.float() - want).abs().max().item() for name, got, want in
                                              zip(("out", "dq", "dk", "dv"), (sdpa, *(t.grad for t in same)),
                                                  (out_ref, *(t.grad for t in ref)))}
            emit(record)


def timed(step, args) -> tuple[float, float]:
    if args.device != "cuda":  # the smoke run: wall clock, no memory figure
        step()
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3, 0.0
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

        def masked_sdpa(**mask):
            allowed = reference_mask(seq, device=args.device, **mask)
            return lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=allowed, enable_gqa=True)

        masks = [dict(window=int(w)) for w in args.windows.split(",")] + [dict(chunk=args.chunk)]
        masks += [dict(documents=tuple(range(0, seq, 8192))), dict(documents=long_tailed_documents(seq))]
        cases = [("sdpa_dense_causal", {}, lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                                          enable_gqa=True))]
        for mask in masks:
            cases.append(("cpctl", mask, lambda a, b, c, m=mask: cpctl_attention(a, b, c, **m)))
            if seq <= args.masked_max:
                cases.append(("sdpa_bool_mask", mask, masked_sdpa(**mask)))
        for name, mask, fn in cases:
            described = {"window": mask.get("window"), "chunk": mask.get("chunk"),
                         "documents": len(mask["documents"]) if "documents" in mask else None}
            try:
                ms, peak = timed(run(fn), args)
                emit({"kind": "time", "case": name, "seq": seq, **described, "ms": round(ms, 2),
                      "peak_gib": round(peak, 2)})
            except Exception as exc:  # noqa: BLE001 - a reference that does not fit is reported, not fatal
                emit({"kind": "time", "case": name, "seq": seq, **described, "error": str(exc).splitlines()[0][:200]})
            if args.device == "cuda":
                torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    if args.device == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        torch.cuda.set_device(0)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"kind": "meta", "device": name, "torch": torch.__version__}
    out = open(args.out, "a") if args.out else None

    def emit(record):
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")

    if args.device == "cuda":  # is a sliding window's band one flash call here, or tiles?
        from cpctl.attention.kernels import windowed_flash_works

        meta["windowed_flash"] = {str(d).removeprefix("torch."): windowed_flash_works(d, args.head_dim, 0)
                                  for d in (torch.bfloat16, torch.float32)}
    emit(meta)
    check(args, emit)
    bench(args, emit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
