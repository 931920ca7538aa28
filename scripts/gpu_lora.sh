#!/usr/bin/env bash
# LoRA r 16 on the Llama-3.1-8B shape, one H200 (issue 32 part 5, docs/benchmarks.md): cpctl vs
# plain transformers + peft + gradient checkpointing, side by side in each run
# (scripts/bench_lora.py under cpctl launch; every row in OUTDIR/lora_h200.jsonl):
#   bash scripts/gpu_lora.sh OUTDIR           # speed, then longest: ~12 minutes, two launches of < 9 each
#   bash scripts/gpu_lora.sh OUTDIR speed     # 32k timed, both systems; plain's longest (48k, 64k, 96k)
#   bash scripts/gpu_lora.sh OUTDIR longest   # cpctl with the memory stack at 256k, two steps
#   bash scripts/gpu_lora.sh OUTDIR mixed     # optional: cpctl at 32k, mixed checkpointing level
#   bash scripts/gpu_lora.sh OUTDIR longer    # optional, ~17 minutes: 384k, run it detached (setsid)
#
# Time, estimated at ~400 TFLOP/s effective: a LoRA step under full checkpointing is forward +
# recompute + the inputs' gradients of the 7.50B matmul parameters (no weight gradients), 6 x 7.50e9
# FLOPs a token, plus causal attention, forward twice (recompute) and backward 2.5 x forward:
# 9 x T^2 x 4096 x 32 layers. Per step: 32k 6.9 s, 48k 13 s, 64k 20 s, 96k 40 s, 128k 65 s, 256k 232 s,
# 384k 500 s, 512k 870 s. (Scaled from the measured 3B-shape 384k step, 268 s, 256k would be ~200 s.)
#   speed:   process start and two 8B builds ~1.5 min; plain 32k (warm-up + 2 timed) 21 s, probes of two
#            steps 48k 26 s, 64k 40 s, 96k 80 s (or ~15 s if it runs out of memory at the logits, as
#            expected: 96k x vocab 128,256 fp32 logits and log-softmax are 47 GiB each); cpctl 32k 21 s.
#            ~3.5-4.5 min.
#   longest: start and build ~1 min; 256k, two steps, 2 x 232 s = 7.7 min; ~8.5 min.
#            (cpctl plan: 50.2 GiB of GPU memory, 66 GiB of pinned host memory.)
#   mixed:   ~1.5 min.   longer: 2 x 500 s + build, ~17.5 min: beyond one 10-minute device call.
# 512k does not fit: cpctl plan needs 132 GiB of host memory for its offloaded activations (125 here),
# and two steps would take ~29 minutes.
set -u
out=${1:-/tmp/cpctl-gpu}; part=${2:-all}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -c "import peft" 2>/dev/null || python -m pip install --no-deps .wheels/peft-0.21.2-py3-none-any.whl
bench() {  # bench LOGNAME [launch flags...] -- [benchmark args...]
  local log=$1; shift; local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done; shift
  python -m cpctl launch --device cuda --nproc-per-node 1 --activation-checkpointing true "${flags[@]}" \
    scripts/bench_lora.py --out "$out/lora_h200.jsonl" "$@" > "$out/lora_$log.log" 2>&1 || tail -5 "$out/lora_$log.log"
}
stack=(--tiled-mlp-tokens 8192 --tiled-norm-tokens 8192 --offload-activations true)
case $part in speed|all)
  bench speed -- --chunked-loss --seqs 32k --plain-probe 48k,64k,96k --probe "" ;; esac
case $part in longest|all)
  bench longest "${stack[@]}" -- --systems cpctl --chunked-loss --seqs "" --probe 256k ;; esac
case $part in mixed)
  bench mixed --checkpoint-level mixed -- --systems cpctl --chunked-loss --seqs 32k ;; esac
case $part in longer)
  bench longer "${stack[@]}" -- --systems cpctl --chunked-loss --seqs "" --probe 384k ;; esac
cat "$out/lora_h200.jsonl"
