"""`cpctl plan`'s step-time predictions past the machines measured here: Llama-3.1-8B and a 70B shape at
1M-4M tokens on 8-64 GPUs in nodes of 8 (NVLink inside, the network between), each with the fastest
layout that fits (planner.rank_layouts), and torchtitan's published 8-GPU context-parallel
configurations on H100s. Predictions, not measurements: the first multi-GPU run checks them.

    python scripts/predict_multinode.py            (markdown tables; no GPU, no torch)
"""

from __future__ import annotations

import dataclasses

from cpctl import planner
from cpctl.planner import ranking

K, M = 1024, 1024**2
MEMORY_OPTIONS = planner.Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=8192,
                               tiled_norm_tokens=8192)


def fastest(model: planner.ModelShape, gpus: int, seq: int, figures: planner.Throughputs,
            gpu_memory_gib: float) -> planner.Ranked | None:
    setup = dataclasses.replace(MEMORY_OPTIONS.with_cp(gpus), gpus_per_node=min(gpus, 8))
    ranked = planner.rank_layouts(model, setup, seq, figures, gpu_memory_gib=gpu_memory_gib)
    return ranked[0] if ranked else None


def long_sequences() -> None:
    print("| model | tokens | GPUs (nodes of 8) | fastest layout that fits | step s | tokens/s per GPU | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        for seq in (1 * M, 2 * M, 4 * M):
            for gpus in (8, 16, 32, 64):
                best = fastest(planner.PRESETS[name], gpus, seq, planner.H200, 141.0)
                if best is None:
                    print(f"| {name} | {planner.format_tokens(seq)} | {gpus} | does not fit | | | |")
                    continue
                print(f"| {name} | {planner.format_tokens(seq)} | {gpus} | {best.label()} | {best.time.total:,.0f} | "
                      f"{best.time.tokens_per_s / gpus:,.0f} | {best.estimate.peak / planner.GiB:.0f} |")


def torchtitan_configurations() -> None:
    """torchtitan's docs/performance.md, Table 2: Llama 3.1 8B on 8 H100s (96 GB), FSDP x CP, full
    checkpointing, local batch 1, torch.compile and Float8 matmuls; cpctl predicted in bf16."""
    published = {1: (32 * K, 3890), 2: (64 * K, 2540), 4: (128 * K, 1071), 8: (256 * K, 548)}
    print("| FSDP x CP | tokens | torchtitan (H100, Float8, compile), tokens/s per GPU | cpctl predicted (H100 figures, bf16) |")
    print("| --- | --- | --- | --- |")
    for cp, (seq, tps) in published.items():
        setup = dataclasses.replace(planner.Setup(activation_checkpointing=True, chunked_loss=True), gpus=8, cp=cp,
                                    dp_shard=8 // cp, gpus_per_node=8)
        time = planner.predict(planner.PRESETS["llama-3.1-8b"], setup, seq, planner.H100)
        print(f"| {8 // cp} x {cp} | {planner.format_tokens(seq)} | {tps:,} | {time.tokens_per_s / 8:,.0f} |")


def alst_lengths() -> None:
    """ALST's published longest Llama-8B sequences on 80 GB H100s (1 GPU, a node of 8, 4 nodes), against
    the longest `cpctl plan` finds with every memory option, activations, parameters and optimizer
    offloaded to 2 TiB hosts (as ALST offloads the optimizer with DeepSpeed)."""
    published = {1: "500K", 8: "3.7M", 32: "15M"}
    options = dataclasses.replace(MEMORY_OPTIONS, offload_activations=True, cpu_offload=True)
    print("| H100s (80 GB) | ALST's longest (published) | cpctl's longest (plan, its layout) | predicted step s there |")
    print("| --- | --- | --- | --- |")
    for gpus, theirs in published.items():
        model = planner.PRESETS["llama-3.1-8b"]
        layouts = [layout for layout in ranking.candidates(model, dataclasses.replace(options.with_cp(gpus),
                                                                                         gpus_per_node=min(gpus, 8)))
                   if layout.activation_checkpointing and layout.checkpoint_level == "full"]
        longest, setup = max((planner.longest_fitting(model, layout, gpu_memory_gib=80.0, host_memory_gib=2048.0),
                              layout) for layout in layouts)
        time = planner.predict(planner.PRESETS["llama-3.1-8b"], setup, longest, planner.H100) if longest else None
        step = f"{time.total:,.0f}" if time else ""
        where = f" ({ranking.Ranked(planner.estimate(model, setup, longest), time).label()})" if time else ""
        print(f"| {gpus} | {theirs} | {planner.format_tokens(longest) if longest else 'none'}{where} | {step} |")


if __name__ == "__main__":
    long_sequences()
    print()
    torchtitan_configurations()
    print()
    alst_lengths()
