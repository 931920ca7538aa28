#!/usr/bin/env bash
# The planner on the families beyond Llama (issue 34): each model's measured peak on one GPU against
# `cpctl plan`'s, with what is live at the peak (scripts/cuda_memory_report.py). Random weights built
# from each config (scripts/bench_train.py --model hf:...), nothing downloaded; activation checkpointing,
# one step holding AdamW's state (--optimizer-state), at 32k tokens:
#   Qwen2.5-1.5B  model(labels=...).loss: its 152k-vocabulary logits in full
#   Gemma-2-2B    chunked loss: 256k vocabulary, soft-capped logits, tied head, 4 norms a block, windows
#   Phi-3-mini    chunked loss: fused qkv and gate/up projections, head dim 96
#   a MoE         chunked loss: a Mixtral-like 2.5B, 4 experts, top 2 (and at 128k, where its experts'
#                 activations weigh)
# On one H200, estimated (not yet run there) at 3-4 minutes: four launches of ~15 s start and a build each,
# one step at 32k (~2 s for the 3.8B Phi-3), the MoE's 128k step ~15 s, and each memory report's replay:
#   bash scripts/gpu_families.sh OUTDIR
# The same families at tiny sizes on CPU, to check the script itself (peaks there are the process's RSS):
#   bash scripts/gpu_families.sh OUTDIR cpu
set -u
out=${1:-/tmp/cpctl-families}; where=${2:-cuda}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
records="$out/families_$where.jsonl"
rm -f "$records"

# The MoE as a config.json (no Hub model has this size; bench_train records the config with each run)
cat > "$out/moe-4x2b.json" <<'EOF'
{"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
 "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 4,
 "num_experts_per_tok": 2, "sliding_window": null, "tie_word_embeddings": false, "dtype": "bfloat16"}
EOF
if [ "$where" = cpu ]; then
  # Each family's own blocks at tiny sizes: a few seconds each on CPU
  for family in qwen2 gemma2 phi3 mixtral; do
    python - "$out/tiny-$family.json" "$family" <<'EOF'
import json, sys
experts = {"num_local_experts": 4, "num_experts_per_tok": 2} if sys.argv[2] == "mixtral" else {}
json.dump({"model_type": sys.argv[2], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4 if sys.argv[2] == "phi3" else 2,
           "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **experts}, open(sys.argv[1], "w"))
EOF
  done
  models=(qwen2 "hf:$out/tiny-qwen2.json" "" 512 ""
          gemma2 "hf:$out/tiny-gemma2.json" --chunked-loss 512 ""
          phi3 "hf:$out/tiny-phi3.json" --chunked-loss 512 ""
          moe "hf:$out/tiny-mixtral.json" --chunked-loss 512 1k)
  report=()
else
  models=(qwen2.5-1.5b hf:qwen2.5-1.5b "" 32k ""
          gemma-2-2b hf:gemma-2-2b --chunked-loss 32k ""
          phi-3-mini hf:phi-3-mini-4k --chunked-loss 32k ""
          moe-4x2b "hf:$out/moe-4x2b.json" --chunked-loss 32k 128k)
  report=(--memory-report)
fi

for ((i = 0; i < ${#models[@]}; i += 5)); do
  name=${models[i]}; model=${models[i+1]}; loss=${models[i+2]}; seq=${models[i+3]}; probe=${models[i+4]}
  python -m cpctl launch --device "$where" --nproc-per-node 1 --activation-checkpointing true \
    scripts/bench_train.py --model "$model" $loss --optimizer-state --warmup 0 --steps 1 --seqs "$seq" \
    --probe "$probe" --out "$records" ${report[@]+"${report[@]}" "$out/$name.report"} > "$out/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$out/$name.log"; }
done

python - "$records" <<'EOF'
import json, sys
from cpctl.planner import format_tokens
print(f"{'model':34s} {'tokens':>7s} {'measured GiB':>12s} {'planned GiB':>11s} {'plan - measured':>15s}")
for line in open(sys.argv[1]):
    run = json.loads(line)
    name = run["model"].rpartition("/")[2].removesuffix(".json").removeprefix("hf:")
    measured, planned = run.get("peak_gib"), run["plan_gib"]
    gap = f"{100 * (planned - measured) / measured:+.1f}%" if measured else run.get("error", "")
    print(f"{name:34s} {format_tokens(run['seq']):>7s} {measured or 0:12.2f} {planned:11.2f} {gap:>15s}")
EOF
ls "$out"/*.rank0.txt 2>/dev/null | sed 's/^/what is live at the peak: /'
