#!/usr/bin/env bash
# One device-tool call on one GPU: the model in and out on CUDA. A save after training
# (model.save_pretrained) reloaded in plain transformers; rt.from_pretrained of a bf16 checkpoint
# (bit-equal weights, the old way's losses); the host memory and time of loading a Llama-3.2-1B
# shape, rt.from_pretrained beside from_pretrained + prepare_model.
#   bash scripts/gpu_model_io.sh OUTDIR
set -u
out=${1:-/tmp/cpctl-gpu}; mkdir -p "$out"; export PYTHONPATH=$PWD:$PWD/tests/workers PYTHONUNBUFFERED=1
work=$(mktemp -d)
CPCTL_MIXED_PRECISION=no python tests/workers/save_routes.py runtime "$work/saved" > "$out/save.log" 2>&1 || tail -5 "$out/save.log"
python - "$work/saved" <<'PY' 2>&1 | grep -v Warn | tee "$out/save_check.txt"
import sys, torch
from pathlib import Path
from transformers import LlamaForCausalLM
from save_routes import PROBE
out = Path(sys.argv[1])
model = LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
with torch.no_grad():
    diff = (model(input_ids=PROBE).logits - torch.load(out / "logits.pt")).abs().max().item()
print(f"cuda save_pretrained after prepare_model, reloaded on the CPU: largest logit difference {diff:.2e}")
PY
python tests/workers/load_cases.py "$work/ckpt" - --write-checkpoint --tied > /dev/null 2>&1
python tests/workers/load_cases.py "$work/ckpt" "$out/load_cases.json" > "$out/load.log" 2>&1 || tail -5 "$out/load.log"
cat "$out/load_cases.json"; echo
python scripts/bench_loading.py --write-checkpoint "$work/llama-1b" > /dev/null 2>&1
python scripts/bench_loading.py --checkpoint "$work/llama-1b" --device cuda --procs 1 --master-weights fp32 keep \
    --out "$out/loading_cuda.jsonl" 2>&1 | grep -v Warn | tee "$out/loading_cuda.txt"
