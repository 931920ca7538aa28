#!/usr/bin/env bash
# The memory-stack benchmark on one H200 (docs/benchmarks.md, "Long sequences on one GPU"),
# in parts that each fit one 10-minute device call:
#   bash scripts/gpu_memory.sh OUTDIR speed     # 1b at 128k: full vs selective checkpointing
#   bash scripts/gpu_memory.sh OUTDIR hf-before # HF Llama-3.2-1B/3B shapes, plain loop: longest length
#   bash scripts/gpu_memory.sh OUTDIR hf-after  # the same with every memory option
#   bash scripts/gpu_memory.sh OUTDIR longest   # 1b with every memory option at 768k
set -u
out=${1:-/tmp/cpctl-gpu}; part=${2:-speed}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # bench LOGNAME [launch flags...] -- [benchmark args...]
  local log=$1; shift; local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done; shift
  python -m cpctl launch --device cuda --nproc-per-node 1 --activation-checkpointing true "${flags[@]}" \
    scripts/bench_train.py --out "$out/memory_h200.jsonl" "$@" > "$out/$log.log" 2>&1 || tail -5 "$out/$log.log"
}
all=(--tiled-mlp-tokens 8192 --offload-activations true)
case $part in
  speed)
    bench full -- --seqs 128k
    bench selective --checkpoint-level selective -- --seqs 128k
    bench full-chunked -- --seqs 128k --chunked-loss
    bench selective-chunked --checkpoint-level selective -- --seqs 128k --chunked-loss ;;
  hf-before)
    bench hf1b-before -- --model hf:llama-3.2-1b --seqs 32k --probe 48k,64k
    bench hf3b-before -- --model hf:llama-3.2-3b --seqs 32k --probe 48k,64k ;;
  hf-after)
    bench hf1b-after "${all[@]}" -- --model hf:llama-3.2-1b --chunked-loss --seqs 32k --probe 512k ;;
  hf3b-after)
    bench hf3b-after "${all[@]}" -- --model hf:llama-3.2-3b --chunked-loss --warmup 0 --steps 1 --seqs 32k --probe 384k ;;
  longest)
    bench longest "${all[@]}" -- --chunked-loss --warmup 0 --steps 1 --seqs 768k ;;
esac
cat "$out/memory_h200.jsonl"
