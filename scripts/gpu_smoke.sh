#!/usr/bin/env bash
# One device-tool call: kernel probe, engine correctness on NCCL, a short side-by-side bench.
#   bash scripts/gpu_smoke.sh OUTDIR [SEQS]
set -u
out=${1:-/tmp/cpctl-gpu}; seqs=${2-32k,128k}  # SEQS empty: no benchmark
mkdir -p "$out"; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python scripts/probe_kernels.py 2>&1 | grep -v Warn | tee "$out/probe.log"
python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/engine_cases.py "$out/engine_cases.jsonl" > "$out/engine_cases.log" 2>&1 || grep -v Warn "$out/engine_cases.log" | grep -m3 -B2 Error
python scripts/summarize.py engine "$out/engine_cases.jsonl"
[ -z "$seqs" ] || python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_attention.py --seqs "$seqs" --warmup 1 --steps 3 --out "$out/bench.jsonl" > "$out/bench.log" 2>&1 || grep -v Warn "$out/bench.log" | grep -m3 -B5 Error
[ -z "$seqs" ] || python scripts/summarize.py bench "$out/bench.log"
