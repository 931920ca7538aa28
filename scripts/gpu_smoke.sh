#!/usr/bin/env bash
# One device-tool call: kernel probe, engine correctness on NCCL, a short side-by-side bench.
#   bash scripts/gpu_smoke.sh OUTDIR [SEQS]
set -u
out=${1:-/tmp/cpctl-gpu}; seqs=${2-32k,128k}  # SEQS empty: no benchmark
mkdir -p "$out"; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python scripts/probe_kernels.py 2>&1 | grep -v Warn | tee "$out/probe.log"
python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/engine_cases.py "$out/engine_cases.jsonl" > "$out/engine_cases.log" 2>&1 || grep -v Warn "$out/engine_cases.log" | grep -m3 -B2 Error
python - "$out/engine_cases.jsonl" <<'PY'
import json, sys
worst = {}
for line in open(sys.argv[1]):
    r = json.loads(line); key = (r["strategy"], r["causal"], r["load_balance"])
    extra = r["sdpa_errors"] or {"sdpa_vs_fp32": {"-": 0}, "cpctl_vs_sdpa": {"-": 0}}
    new = (max(r["errors"].values()), max(extra["sdpa_vs_fp32"].values()), max(extra["cpctl_vs_sdpa"].values()))
    worst[key] = tuple(max(a, b) for a, b in zip(worst.get(key, (0, 0, 0)), new))
for key, (cp, sdpa, gap) in worst.items():
    print("engine", key, f"max abs error: cpctl vs fp32 {cp:.3g}, SDPA vs fp32 {sdpa:.3g}, cpctl vs SDPA {gap:.3g}")
PY
[ -z "$seqs" ] || python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_attention.py --seqs "$seqs" --warmup 1 --steps 3 --out "$out/bench.jsonl" > "$out/bench.log" 2>&1 || grep -v Warn "$out/bench.log" | grep -m3 -B5 Error
grep '^{' "$out/bench.log" | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['engine'], r['strategy'], r['seq'], r['ms'], r.get('tflops_per_gpu'), r.get('peak_gib'))"
