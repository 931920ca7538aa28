#!/usr/bin/env bash
# The step-time model (issue 34): this GPU's throughputs as `cpctl plan --calibrate` measures them,
# then warm steps (one warm-up, the median of two) of the rows whose recorded times were not warm:
# the families' 32k runs (recorded with the allocator's history on, for their memory reports) and
# the Llama-3.2-3B shape at 32k with the memory options (recorded as a first and only step).
#   bash scripts/gpu_timing.sh OUTDIR        (one H200: about 4 minutes)
set -u
out=${1:-/tmp/cpctl-timing}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$out/cache"
python -m cpctl plan --calibrate --json > "$out/throughputs.json" 2> "$out/calibrate.log" || tail -5 "$out/calibrate.log"
cat "$out/throughputs.json"

records="$out/timing_h200.jsonl"
cat > "$out/moe-4x2b.json" <<'JSON'
{"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
 "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 4,
 "num_experts_per_tok": 2, "sliding_window": null, "tie_word_embeddings": false, "dtype": "bfloat16"}
JSON
run() {  # name, then cpctl launch's options, --, then bench_train's
  local name=$1; shift
  local launch=(); while [ "$1" != -- ]; do launch+=("$1"); shift; done; shift
  python -m cpctl launch --device cuda --nproc-per-node 1 --activation-checkpointing true "${launch[@]}" \
    scripts/bench_train.py "$@" --warmup 1 --steps 2 --out "$records" > "$out/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$out/$name.log"; }
}
run qwen2.5-1.5b -- --model hf:qwen2.5-1.5b --seqs 32k
run gemma-2-2b -- --model hf:gemma-2-2b --chunked-loss --seqs 32k
run phi-3-mini -- --model hf:phi-3-mini-4k --chunked-loss --seqs 32k
run moe-4x2b -- --model "hf:$out/moe-4x2b.json" --chunked-loss --seqs 32k
run llama-3.2-3b-options --tiled-mlp-tokens 8192 --offload-activations true -- --model hf:llama-3.2-3b --chunked-loss --seqs 32k
run qwen3-8b -- --model hf:qwen3-8b --chunked-loss --seqs 32k,64k
cat "$records"
