"""End-to-end training throughput and memory of a ~1.1B Llama at long sequence lengths.

bf16 (FSDP2 mixed precision), activation checkpointing, AdamW, one sequence per step.
Run once per GPU count through cpctl's own launcher; each run appends JSON lines:

    python -m cpctl launch --nproc-per-node 1 --cp-size 1 --device cuda scripts/bench_train.py \
        --seqs 32k,64k,128k --out docs/benchmarks/train_h200x2.jsonl
    python -m cpctl launch --nproc-per-node 2 --cp-size 2 --device cuda scripts/bench_train.py \
        --seqs 64k,128k,256k --out docs/benchmarks/train_h200x2.jsonl

Measured on 2 x H200 (nvidia-h200-x2), torch 2.11. Fields: world, cp, seq, step_s (median),
tokens_per_s, mfu (model FLOPs incl. causal attention, over 989 TFLOP/s dense bf16 per GPU,
the H200 datasheet figure), peak_gib (max over ranks of torch's peak allocated memory), and
error "out of memory" where a length does not train. `--probe` lengths run one step only, to
find the longest sequence that trains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cpctl

# The model and the training step are the example's own (scripts/llama.py, scripts/train_llama.py),
# imported from beside this file however it is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import PRESETS, Llama  # noqa: E402
from train_llama import train_step  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
K = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--seqs", default="32k,64k,128k", help="lengths to time, e.g. 32k,64k")
    p.add_argument("--probe", default="", help="longer lengths to try once each, to find the longest that trains")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def tokens(label: str) -> int:
    return int(label[:-1]) * K if label.endswith("k") else int(label)


def run_length(rt, model, optimizer, seq: int, *, warmup: int, steps: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(model.cfg.vocab_size, (1, seq), generator=gen)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(rt, model, optimizer, ids.clone())
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=rt.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens_per_s = seq / step_s
    mfu = model.flops_per_token(seq) * tokens_per_s / (rt.world_size * H200_BF16_DENSE_TFLOPS * 1e12)
    return dict(step_s=round(step_s, 3), tokens_per_s=round(tokens_per_s), mfu=round(mfu, 3),
                peak_gib=round(peak.item(), 2))


def main(argv=None):
    args = parse_args(argv)
    rt = cpctl.init(activation_checkpointing=True)  # the benchmark's setting, whatever the profile says
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(cfg).parameters())
    model = rt.prepare_model(Llama(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = [(label, args.warmup, args.steps) for label in args.seqs.split(",") if label]
    plan += [(label, 0, 1) for label in args.probe.split(",") if label]
    for label, warmup, steps in plan:
        seq = tokens(label)
        record = dict(preset=args.preset, params=n_params, world=rt.world_size, cp=rt.cp_size,
                      strategy=rt.config.parallelism.cp_comm_strategy, seq=seq, probe=steps == 1 and warmup == 0,
                      gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        try:
            record.update(run_length(rt, model, optimizer, seq, warmup=warmup, steps=steps))
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            record["error"] = "out of memory"
        if rt.is_main:
            print(json.dumps(record), flush=True)
            if args.out:
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if "error" in record:
            break


if __name__ == "__main__":
    main()
