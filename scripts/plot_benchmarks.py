"""Render the benchmark JSON lines as PNG plots (needs the `plot` extra: matplotlib).

    python scripts/plot_benchmarks.py docs/benchmarks/attention_h200x2.jsonl docs/benchmarks/train_h200x2.jsonl

Each input `X.jsonl` becomes `X.png` beside it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_attention(records: list[dict], out: Path) -> None:
    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    single = {r["seq"]: r["ms"] for r in records if r["engine"] == "single" and r.get("ms")}
    for r in records:
        if r.get("ms") and r["engine"] != "single":
            series[f"{r['engine']} {r['strategy']}"].append((r["seq"], r["ms"], r["peak_gib"]))
    fig, (ax_eff, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in sorted(series.items()):
        points.sort()
        seqs = [s for s, _, _ in points if s in single]
        world = next(r["world"] for r in records if f"{r['engine']} {r['strategy']}" == name)
        ax_eff.plot([s // 1024 for s in seqs], [100 * single[s] / (world * ms) for s, ms, _ in points if s in single],
                    marker="o", label=name, linestyle="-" if name.startswith("cpctl") else "--")
        ax_mem.plot([s // 1024 for s, _, _ in points], [m for _, _, m in points], marker="o", label=name,
                    linestyle="-" if name.startswith("cpctl") else "--")
    ax_eff.set(xscale="log", xlabel="sequence length", ylabel="scaling efficiency %  t1 / (N t_cp)",
               title="causal attention fwd+bwd, 2 x H200")
    ax_mem.set(xscale="log", xlabel="sequence length", ylabel="peak memory per GPU (GiB)",
               title="memory per GPU")
    for ax in (ax_eff, ax_mem):
        ticks = sorted({r["seq"] // 1024 for r in records})
        ax.set_xticks(ticks, [f"{t}k" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_training(records: list[dict], out: Path) -> None:
    fig, (ax_mem, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    for world in sorted({r["world"] for r in records}):
        done = sorted((r["seq"], r) for r in records if r["world"] == world and "error" not in r)
        label = f"{world} GPU" + ("s (cp %d)" % world if world > 1 else "")
        ax_mem.plot([s // 1024 for s, _ in done], [r["peak_gib"] for _, r in done], marker="o", label=label)
        ax_tok.plot([s // 1024 for s, _ in done], [r["tokens_per_s"] for _, r in done], marker="o", label=label)
    ax_mem.axhline(141, color="grey", linestyle=":", label="H200 memory")
    ax_mem.set(xlabel="sequence length (k tokens)", ylabel="peak memory per GPU (GiB)",
               title="1.1B Llama training, bf16, FSDP2 + AC")
    ax_tok.set(xlabel="sequence length (k tokens)", ylabel="tokens / s (whole job)", title="throughput")
    for ax in (ax_mem, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(paths: list[str]) -> None:
    for name in paths:
        path = Path(name)
        records = load(path)
        plot = plot_attention if "engine" in records[0] else plot_training
        plot(records, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main(sys.argv[1:])
