#!/usr/bin/env bash
# One device-tool call on 2 GPUs: the example's losses with NCCL (cp2 vs one GPU, fp32), then
# the training benchmark on 1 and 2 GPUs through cpctl launch.
#   bash scripts/gpu_train.sh OUTDIR
set -u
out=${1:-/tmp/cpctl-gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ "${SKIP_LOSSES:-0}" = 1 ] || for run in "1 1" "2 2"; do
  set -- $run
  CPCTL_MIXED_PRECISION=no python -m cpctl launch --device cuda --nproc-per-node $1 --cp-size $2 \
    scripts/train_llama.py --steps 6 --seq-len 4096 --global-batch 1 --losses-out "$out/losses_cp$2.json" \
    > "$out/train_cp$2.log" 2>&1 || tail -5 "$out/train_cp$2.log"
done
[ "${SKIP_LOSSES:-0}" = 1 ] || python scripts/summarize.py losses "$out/losses_cp1.json" "$out/losses_cp2.json"
[ "${SKIP_ONE_GPU:-0}" = 1 ] || python -m cpctl launch --device cuda --nproc-per-node 1 --cp-size 1 --activation-checkpointing true scripts/bench_train.py \
  --seqs 32k,64k,128k --probe 192k,256k --out "$out/train_h200x2.jsonl" > "$out/bench_train1.log" 2>&1 || tail -5 "$out/bench_train1.log"
python -m cpctl launch --device cuda --nproc-per-node 2 --cp-size 2 --activation-checkpointing true scripts/bench_train.py \
  --seqs 64k,128k,256k --probe 384k,512k --out "$out/train_h200x2.jsonl" > "$out/bench_train2.log" 2>&1 || tail -5 "$out/bench_train2.log"
cat "$out/train_h200x2.jsonl"
