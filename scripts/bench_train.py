"""Training throughput and memory at long sequence lengths, with cpctl's memory options.

The model is the example's (`--model 1b`, scripts/llama.py) or an unmodified Hugging Face model
with a real model's shape and vocabulary and random weights, built from its config (nothing is
downloaded): `--model hf:llama-3.2-1b`, `hf:qwen2.5-7b`, `hf:gemma-2-2b`, ... (the presets `cpctl
plan` knows, of any family it counts), or `hf:path/to/config.json` (recorded with the config, so that
the planner can read the run back). bf16 (FSDP2 mixed precision), AdamW, one sequence per step. Activation checkpointing and the memory
options are the profile's (`--activation-checkpointing`, `--checkpoint-level`,
`--tiled-mlp-tokens`, `--offload-activations`, ...); `--chunked-loss` takes the loss from the
hidden states a chunk at a time. Each run appends JSON lines, one per length:

    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        scripts/bench_train.py --seqs 32k,64k,128k --out docs/benchmarks/train_h200x2.jsonl
    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        --tiled-mlp-tokens 8192 --offload-activations true \
        scripts/bench_train.py --model hf:llama-3.2-1b --chunked-loss --seqs 32k --probe 512k

The longest runs on one H200 (a single step each, the AdamW state made first so that the step
holds it, as every step after the first does), and the mixed checkpointing level at 128k:

    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        --tiled-mlp-tokens 8192 --offload-activations true \
        scripts/bench_train.py --model hf:llama-3.2-3b --chunked-loss --optimizer-state --seqs "" --probe 512k
    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        --tiled-mlp-tokens 8192 --offload-activations true \
        scripts/bench_train.py --model 1b --chunked-loss --optimizer-state --seqs "" --probe 1M
    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        --checkpoint-level mixed scripts/bench_train.py --model hf:llama-3.2-3b --chunked-loss --seqs 128k

Fields: world, cp, seq, the options, step_s (median), tokens_per_s, mfu (model FLOPs incl.
causal attention, over 989 TFLOP/s dense bf16 per GPU, the H200 datasheet figure), peak_gib
(max over ranks of torch's peak allocated memory), plan_gib (what `cpctl plan` predicts for
the same setup), plan_step_s (its predicted step time, over the cached calibration or the
built-in H200 figures), memory_history and cold_start (the step's time is not a warm one: the
allocator's history was recorded, or it was the process's first step), host_gib and plan_host_gib (the host memory the offloaded activations took,
rank 0's, and `cpctl plan`'s figure), selective_blocks (the mixed level's count, as applied),
and error "out of memory" where a length does not train. `--probe` lengths run one step only,
to find the longest sequence that trains.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cpctl
from cpctl import planner
from cpctl.errors import CpctlError

# The example's model and training step (scripts/llama.py, scripts/train_llama.py), imported
# from beside this file however it is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_memory_report  # noqa: E402
from llama import PRESETS, Llama  # noqa: E402
from train_llama import peak_memory_gib, train_step  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
HF_PREFIX = "hf:"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "--preset", default="1b",
                   help=f"an example preset ({', '.join(sorted(PRESETS))}), hf:<a preset of cpctl plan> "
                        f"({', '.join(HF_PREFIX + n for n in planner.PRESETS if n not in PRESETS)}) or "
                        "hf:<a Hugging Face config.json>")
    p.add_argument("--seqs", default="32k,64k,128k", help="lengths to time, e.g. 32k,64k")
    p.add_argument("--probe", default="", help="longer lengths to try once each, to find the longest that trains")
    p.add_argument("--chunked-loss", action="store_true", help="the loss a chunk of tokens at a time")
    p.add_argument("--optimizer-state", action="store_true",
                   help="make AdamW's state before the first step (one step on zero gradients), so that a single "
                        "probe step holds it as a second step would")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--memory-report", default=None, metavar="PATH",
                   help="CUDA: record the allocator's history over the last length's steps and write what is "
                        "allocated at the peak (scripts/cuda_memory_report.py)")
    args = p.parse_args(argv)
    if args.model not in PRESETS and not (args.model.startswith(HF_PREFIX) and hf_shape(args.model)):
        p.error(f"--model {args.model}: not an example preset nor hf:<a shape cpctl plan knows, or a config.json>")
    return args


def hf_shape(model: str) -> planner.ModelShape | None:
    """hf:<preset or config.json>'s shape, as `cpctl plan --model` reads it; None if it names neither."""
    try:
        return planner.load_model(model.removeprefix(HF_PREFIX))
    except CpctlError:
        return None


def hf_config_json(model: str) -> dict | None:
    """The config.json an hf:<path> names (None for a preset): recorded with each run, so that the
    planner can read the run back where the file is not (tests/test_planner.py)."""
    spec = model.removeprefix(HF_PREFIX)
    if spec in planner.PRESETS:
        return None
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    return json.loads(path.read_text())


def model_config(shape: planner.ModelShape, *, max_seq: int, config_json: dict | None = None):
    """The transformers config of a planner shape (its family's model; a config.json's as given)."""
    from transformers import AutoConfig

    # A preset as its family's config (Llama's with Llama 3's rope theta; a rope changes no cost).
    given = config_json if config_json is not None else {
        **shape.hf_config(), **({"rope_theta": 500000.0} if shape.family == "llama" else {})}
    # transformers' default attention (sdpa where the model takes it, eager for Gemma 2): rt.prepare_model
    # puts cpctl's in its place either way
    config = AutoConfig.for_model(**{key: value for key, value in given.items() if key != "architectures"},
                                  max_position_embeddings=max(max_seq, given.get("max_position_embeddings", 0)),
                                  use_cache=False)
    if getattr(config, "attn_logit_softcapping", None) is not None:  # Gemma 2: cpctl's kernels cannot cap scores
        config.attn_logit_softcapping = None
    return config


def write_record(rt, record: dict, out: str | None) -> None:
    """One run's JSON line, on rank 0: printed, and appended to `out` when given."""
    if rt.is_main:
        print(json.dumps(record), flush=True)
        if out:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")


class HuggingFaceLlama:
    """An unmodified transformers model of a planner shape (a LlamaForCausalLM for the Llama presets,
    the family's own model for the others, or a config.json's), and its training step."""

    def __init__(self, rt, shape: planner.ModelShape, *, max_seq: int, chunked_loss: bool,
                 config_json: dict | None = None):
        from transformers import AutoModelForCausalLM

        config = model_config(shape, max_seq=max_seq, config_json=config_json)
        with torch.device(rt.device):  # random weights, made where they will live (in the config's dtype)
            self.model = rt.prepare_model(AutoModelForCausalLM.from_config(config))
        self.rt, self.shape, self.chunked_loss = rt, shape, chunked_loss
        self.vocab_size = shape.vocab_size

    def step(self, optimizer, ids: torch.Tensor) -> None:
        rt, ids = self.rt, ids.to(self.rt.device)
        labels, pos = ids.clone(), cpctl.position_ids_like(ids)  # transformers shifts labels itself
        with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                       no_restore_buffers={ids, labels, pos}):
            if self.chunked_loss:
                loss = rt.causal_lm_loss(self.model, input_ids=ids, labels=labels, position_ids=pos)
            else:
                loss = self.model(input_ids=ids, labels=labels, position_ids=pos).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul parameters a token runs through (blocks, its top-k experts, head) + causal attention,
        as the example counts."""
        shape = self.shape
        return 6 * (shape.active_layers_params + shape.vocab_size * shape.dim) + 6 * shape.n_layers * shape.dim * seq_len


class ExampleLlama:
    """scripts/llama.py's model and scripts/train_llama.py's step."""

    def __init__(self, rt, name: str, *, chunked_loss: bool):
        torch.manual_seed(0)
        self.model = rt.prepare_model(Llama(PRESETS[name]))
        self.rt, self.chunked_loss = rt, chunked_loss
        self.vocab_size = PRESETS[name].vocab_size
        self.flops_per_token = self.model.flops_per_token

    def step(self, optimizer, ids: torch.Tensor) -> None:
        train_step(self.rt, self.model, optimizer, ids, chunked_loss=self.chunked_loss)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_length(rt, bench, optimizer, seq: int, *, warmup: int, steps: int, memory_report: str | None = None) -> dict:
    if rt.device.type == "cuda":  # on CPU (a smoke run) the peak is the process's RSS
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    recording = cuda_memory_report.recording() if memory_report else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(bench.vocab_size, (1, seq), generator=gen)
    times = []
    with recording as history:
        for i in range(warmup + steps):
            dist.barrier()
            synchronize(rt.device)
            start = time.perf_counter()
            bench.step(optimizer, ids.clone())
            synchronize(rt.device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    if memory_report:
        Path(memory_report).with_suffix(f".rank{rt.rank}.txt").write_text(cuda_memory_report.report(history) + "\n")
    step_s = statistics.median(times)
    peak = torch.tensor(peak_memory_gib(rt.device)[1], device=rt.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens_per_s = seq / step_s
    mfu = bench.flops_per_token(seq) * tokens_per_s / (rt.world_size * H200_BF16_DENSE_TFLOPS * 1e12)
    return dict(step_s=round(step_s, 3), tokens_per_s=round(tokens_per_s), mfu=round(mfu, 3),
                peak_gib=round(peak.item(), 2))


# The settings a row was measured with, as the planner's Setup names them: what it needs to predict it.
RECORDED_OPTIONS = ("activation_checkpointing", "checkpoint_level", "selective_blocks", "chunked_loss",
                    "tiled_mlp_tokens", "tiled_norm_tokens", "offload_activations", "cpu_offload", "logits_kept",
                    "first_step")


def make_optimizer_state(model, optimizer) -> None:
    """AdamW's state, made by one step on zero gradients (the parameters barely move: weight decay)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv=None):
    args = parse_args(argv)
    rt = cpctl.init()
    if args.memory_report and rt.device.type != "cuda":
        raise SystemExit("--memory-report records the CUDA allocator: run with --device cuda")
    lengths = [(label, args.warmup, args.steps) for label in args.seqs.split(",") if label]
    lengths += [(label, 0, 1) for label in args.probe.split(",") if label]
    name = args.model.removeprefix(HF_PREFIX)
    shape = hf_shape(args.model) if args.model.startswith(HF_PREFIX) else planner.PRESETS[name]
    config_json = hf_config_json(args.model) if args.model.startswith(HF_PREFIX) else None
    if args.model.startswith(HF_PREFIX):
        longest = max(planner.parse_tokens(label) for label, _, _ in lengths)
        bench = HuggingFaceLlama(rt, shape, max_seq=longest, chunked_loss=args.chunked_loss, config_json=config_json)
    else:
        bench = ExampleLlama(rt, name, chunked_loss=args.chunked_loss)
    n_params = sum(p.numel() for p in bench.model.parameters())
    optimizer = torch.optim.AdamW(bench.model.parameters(), lr=1e-4)
    if args.optimizer_state:
        make_optimizer_state(bench.model, optimizer)
    # The HF step keeps only model(labels=...).loss, not the logits.
    profile_setup = dataclasses.replace(planner.Setup.from_profile(rt.config, chunked_loss=args.chunked_loss),
                                        logits_kept=not args.model.startswith(HF_PREFIX))
    for index, (label, warmup, steps) in enumerate(lengths):
        # AdamW has no state before the process's first optimizer step.
        setup = dataclasses.replace(profile_setup, first_step=index == 0 and warmup == 0 and not args.optimizer_state)
        seq = planner.parse_tokens(label)
        record = dict(model=args.model, params=n_params, world=rt.world_size, cp=rt.cp_size,
                      strategy=rt.config.parallelism.cp_comm_strategy, seq=seq, probe=steps == 1 and warmup == 0,
                      gpu=torch.cuda.get_device_name() if rt.device.type == "cuda" else "cpu", torch=torch.__version__,
                      date=time.strftime("%Y-%m-%d"), **({"hf_config": config_json} if config_json else {}))
        last = index == len(lengths) - 1
        if args.memory_report and last:
            record["memory_history"] = True  # the allocator records every event: the step is slower
        if index == 0 and warmup == 0:
            record["cold_start"] = True  # the process's first step: one-time costs in its time
        try:
            record.update(run_length(rt, bench, optimizer, seq, warmup=warmup, steps=steps,
                                     memory_report=args.memory_report if last else None))
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            record["error"] = "out of memory"
        if rt.selective_blocks is not None and setup.checkpoint_level == "mixed":
            setup = dataclasses.replace(setup, selective_blocks=rt.selective_blocks)  # what the runtime applied
        planned = planner.estimate(shape, setup, seq)
        record.update({option: getattr(planned.setup, option) for option in RECORDED_OPTIONS},
                      plan_gib=round(planned.peak / planner.GiB, 2), plan_host_gib=round(planned.host_bytes / planner.GiB, 2),
                      plan_step_s=round(planner.predict(shape, planned.setup, seq, planner.throughputs_for()).total, 3))
        if rt.host_arena is not None:
            record["host_gib"] = round(rt.host_arena.peak_bytes / planner.GiB, 2)
        write_record(rt, record, args.out)
        if "error" in record:
            break


if __name__ == "__main__":
    main()
