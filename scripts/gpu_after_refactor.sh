#!/usr/bin/env bash
# The runtime's refactor (a thin Runtime over its step context and model preparation) changes no
# number: the example's 1b at 32k, the Hugging Face Llama-3.2-1B shape at 32k with the memory options,
# and LoRA on the Llama-3.1-8B shape at 32k, each as recorded before (train_h200x2.jsonl,
# tiled_norms_1b_h200.jsonl, lora_h200.jsonl), one warm-up and two timed steps.
#   bash scripts/gpu_after_refactor.sh OUTDIR     (one H200, peft installed: about 4 minutes)
set -u
out=${1:-/tmp/cpctl-after}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
records="$out/after_refactor_h200.jsonl"
launch=(python -m cpctl launch --device cuda --nproc-per-node 1 --activation-checkpointing true)
"${launch[@]}" scripts/bench_train.py --model 1b --seqs 32k --out "$records" > "$out/1b.log" 2>&1 || tail -5 "$out/1b.log"
"${launch[@]}" --tiled-mlp-tokens 8192 --offload-activations true scripts/bench_train.py --model hf:llama-3.2-1b \
  --chunked-loss --seqs 32k --out "$records" > "$out/hf1b.log" 2>&1 || tail -5 "$out/hf1b.log"
"${launch[@]}" scripts/bench_lora.py --systems cpctl --chunked-loss --seqs 32k --out "$records" > "$out/lora.log" 2>&1 \
  || tail -5 "$out/lora.log"
cat "$records"
