"""One-screen summaries of what the GPU scripts (gpu_smoke.sh, gpu_train.sh) write.

    python scripts/summarize.py engine OUT/engine_cases.jsonl   # worst errors per (strategy, causal, balance)
    python scripts/summarize.py bench OUT/bench.log             # the JSON records bench_attention.py printed
    python scripts/summarize.py losses OUT/losses_cp1.json OUT/losses_cp2.json
"""

from __future__ import annotations

import argparse
import json


def engine(path: str) -> None:
    """tests/workers/engine_cases.py's records: cpctl vs fp32, SDPA vs fp32, cpctl vs SDPA, worst per group."""
    worst: dict[tuple, tuple[float, float, float]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = (r["strategy"], r["causal"], r["load_balance"])
            extra = r["sdpa_errors"] or {"sdpa_vs_fp32": {"-": 0}, "cpctl_vs_sdpa": {"-": 0}}
            new = (max(r["errors"].values()), max(extra["sdpa_vs_fp32"].values()), max(extra["cpctl_vs_sdpa"].values()))
            worst[key] = tuple(max(a, b) for a, b in zip(worst.get(key, (0, 0, 0)), new))
    for key, (cp, sdpa, gap) in worst.items():
        print("engine", key, f"max abs error: cpctl vs fp32 {cp:.3g}, SDPA vs fp32 {sdpa:.3g}, cpctl vs SDPA {gap:.3g}")


def bench(path: str) -> None:
    """The JSON lines among scripts/bench_attention.py's output."""
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                print(r["engine"], r["strategy"], r["seq"], r["ms"], r.get("tflops_per_gpu"), r.get("peak_gib"))


def losses(one_gpu: str, cp: str) -> None:
    """Two --losses-out files of scripts/train_llama.py side by side, and their largest difference."""
    a, b = (json.load(open(path))["losses"] for path in (one_gpu, cp))
    print("NCCL fp32 losses 1 GPU :", [round(x, 5) for x in a])
    print("NCCL fp32 losses cp=2  :", [round(x, 5) for x in b], "max diff", max(abs(x - y) for x, y in zip(a, b)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("engine").add_argument("path")
    sub.add_parser("bench").add_argument("path")
    pair = sub.add_parser("losses")
    pair.add_argument("one_gpu")
    pair.add_argument("cp")
    args = p.parse_args(argv)
    if args.what == "losses":
        losses(args.one_gpu, args.cp)
    else:
        {"engine": engine, "bench": bench}[args.what](args.path)


if __name__ == "__main__":
    main()
