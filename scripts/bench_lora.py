"""LoRA at long sequences on one GPU: cpctl's runtime vs plain transformers + peft, in one run.

The model is an unmodified Hugging Face `LlamaForCausalLM` of a shape `cpctl plan` knows
(`--model hf:llama-3.1-8b`, the default; `tiny` for a CPU check), random weights made in bf16 where
they will live, with peft's LoRA on every linear projection of the blocks
(`LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)`): the base
frozen in bf16, the adapters fp32 (peft's autocast_adapter_dtype), AdamW over the adapters, one
sequence per step. Two systems, each on its own copy of the same model, one after the other in
one process (the first freed before the second is built), so both rows come from one run:

* `plain`: transformers + peft as their documentation trains it, without cpctl:
  `model.gradient_checkpointing_enable()` (non-reentrant), SDPA attention, bf16 autocast (what
  `Trainer(bf16=True)` runs), the model's own loss (`labels=`). One process: it needs world 1.
* `cpctl`: `rt.prepare_model(peft_model)` under `cpctl launch`, whose flags set activation
  checkpointing and the memory options (`--tiled-mlp-tokens`, `--offload-activations`, ...), and
  scripts/bench_train.py's Hugging Face step; `--chunked-loss` takes the loss with
  `rt.causal_lm_loss`.

Each run appends JSON lines, one per (system, length):

    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        scripts/bench_lora.py --chunked-loss --seqs 32k --plain-probe 48k,64k,96k --probe "" \
        --out docs/benchmarks/lora_h200.jsonl
    python -m cpctl launch --nproc-per-node 1 --device cuda --activation-checkpointing true \
        --tiled-mlp-tokens 8192 --tiled-norm-tokens 8192 --offload-activations true \
        scripts/bench_lora.py --systems cpctl --chunked-loss --seqs "" --probe 256k \
        --out docs/benchmarks/lora_h200.jsonl

(`bash scripts/gpu_lora.sh OUTDIR` runs both on one H200, with the time each takes.) On a CPU,
end to end on the tiny shape:

    python -m cpctl launch --nproc-per-node 1 --device cpu scripts/bench_lora.py --model tiny \
        --seqs 256 --probe 512 --steps 2 --out /tmp/lora.jsonl

Fields: system, model, params, trainable (the adapters' parameters, as peft counts them), lora
(rank, targets, dropout, base_dtype: the planner's Lora) and lora_alpha, base_dtypes and
adapter_dtypes (of the frozen and the trained parameters, as trained), world, cp and strategy
(cpctl), seq, probe, step_s (median), tokens_per_s, mfu (model FLOPs: the frozen matmuls forward
and their inputs' gradients, 4 x their parameters; the adapters' 6 x; causal attention as
bench_train counts it; over 989 TFLOP/s dense bf16 per GPU, the H200 datasheet figure), peak_gib
(torch.cuda.max_memory_allocated, reset per length; null on CPU), and error "out of memory" where
a length does not train (the system's longer lengths are then skipped). The cpctl rows add the
options as the planner's Setup names them, plan_gib and plan_host_gib (what `cpctl plan
--lora-rank R --base-dtype bf16` predicts for the same setup; not for plain, which the planner
does not model), and host_gib (the host memory the offloaded activations took). `--seqs` lengths
are timed (`--warmup` steps, then `--steps`); `--probe` lengths run two steps, the second timed, to
find the longest sequence that trains two steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

import cpctl
from cpctl import planner

# bench_train's Hugging Face step and its timing of one length, imported from beside this file
# however it is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import (  # noqa: E402
    HF_PREFIX, RECORDED_OPTIONS, HuggingFaceLlama, model_config, run_length, write_record,
)

SYSTEMS = ("plain", "cpctl")  # the order they run in: plain's model is freed before cpctl's is built


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=HF_PREFIX + "llama-3.1-8b",
                   help=f"a shape cpctl plan knows ({', '.join(planner.PRESETS)}; {HF_PREFIX}<shape> too)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="plain, cpctl or both, run in that order")
    p.add_argument("--seqs", default="32k", help="lengths to time, e.g. 32k,64k")
    p.add_argument("--probe", default="", help="longer lengths to train two steps each, to find the longest")
    p.add_argument("--plain-probe", default=None,
                   help="the plain system's probe lengths instead of --probe (its longest is a few times shorter)")
    p.add_argument("--chunked-loss", action="store_true",
                   help="cpctl's system: the loss a chunk of tokens at a time (rt.causal_lm_loss)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--memory-report", default=None, metavar="PATH",
                   help="CUDA: what is allocated at the peak of cpctl's last length (scripts/cuda_memory_report.py)")
    args = p.parse_args(argv)
    if args.model.removeprefix(HF_PREFIX) not in planner.PRESETS:
        p.error(f"--model {args.model}: not a shape cpctl plan knows ({', '.join(planner.PRESETS)})")
    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown or not systems:
        p.error(f"--systems {args.systems}: name some of {', '.join(SYSTEMS)}")
    args.systems = [name for name in SYSTEMS if name in systems]
    return args


def lora_llama(shape: planner.ModelShape, *, device: torch.device, max_seq: int, rank: int, alpha: int):
    """The shape as an unmodified transformers LlamaForCausalLM, random weights made in bf16 on
    `device` (an 8B model never exists in fp32, nor on the host), with peft's adapters on every
    linear projection of the blocks: the base frozen, the adapters fp32 (autocast_adapter_dtype)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = model_config(shape, max_seq=max_seq)  # as bench_train's HuggingFaceLlama makes it
    torch.manual_seed(0)  # both systems get the same weights
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=planner.ALL_LINEAR,
                                            lora_dropout=0.0))


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def dtypes(model, *, trained: bool) -> list[str]:
    return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad == trained})


def lora_flops_per_token(shape: planner.ModelShape, lora: planner.Lora, seq_len: int) -> float:
    """Model FLOPs of a LoRA step, per token: the frozen matmuls (blocks and head) forward and their
    inputs' gradients, 4 x their parameters (no weight gradients); the adapters' 6 x; causal
    attention as bench_train counts it. Recompute is not counted (model FLOPs, as MFU counts)."""
    frozen = shape.n_layers * shape.block_params + shape.vocab_size * shape.dim
    return 4 * frozen + 6 * shape.n_layers * lora.params_per_layer(shape) + 6 * shape.n_layers * shape.dim * seq_len


class PlainLora:
    """The `plain` system: transformers + peft without cpctl, as their documentation trains it."""

    def __init__(self, device: torch.device, shape: planner.ModelShape, lora: planner.Lora, *, max_seq: int,
                 alpha: int):
        self.model = lora_llama(shape, device=device, max_seq=max_seq, rank=lora.rank, alpha=alpha)
        self.trainable = trainable_params(self.model)
        # Non-reentrant: the frozen embeddings' output needs no requires_grad for the adapters'
        # gradients to flow, so enable_input_require_grads is not needed (reentrant would need it).
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()  # transformers checkpoints only in training mode
        self.device, self.shape, self.lora = device, shape, lora
        self.vocab_size = shape.vocab_size

    def step(self, optimizer, ids: torch.Tensor) -> None:
        ids = ids.to(self.device)
        # bf16 autocast, as Trainer(bf16=True) runs: the fp32 adapters compute in bf16 (without it
        # peft casts each adapted projection's input to fp32), as under cpctl's mixed precision.
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(input_ids=ids, labels=ids).loss  # transformers shifts labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def flops_per_token(self, seq_len: int) -> float:
        return lora_flops_per_token(self.shape, self.lora, seq_len)


class CpctlLora(HuggingFaceLlama):
    """The `cpctl` system: the PEFT model given to rt.prepare_model, and bench_train's Hugging Face
    step (maybe_context_parallel, model(labels=...).loss or rt.causal_lm_loss); only the model differs."""

    def __init__(self, rt, shape: planner.ModelShape, lora: planner.Lora, *, max_seq: int, alpha: int,
                 chunked_loss: bool):
        # Not HuggingFaceLlama.__init__: it prepares the model it builds, and peft's adapters must be
        # there before rt.prepare_model (FSDP2 shards only the parameters it sees).
        peft_model = lora_llama(shape, device=rt.device, max_seq=max_seq, rank=lora.rank, alpha=alpha)
        self.trainable = trainable_params(peft_model)  # before FSDP2 shards it
        self.model = rt.prepare_model(peft_model)
        self.model.train()
        self.rt, self.shape, self.lora, self.chunked_loss = rt, shape, lora, chunked_loss
        self.vocab_size = shape.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        return lora_flops_per_token(self.shape, self.lora, seq_len)


def free_memory(device: torch.device) -> None:
    """What an out-of-memory step or a finished system left: its tensors are unreferenced once the
    exception or the objects are gone; give the cached blocks back so that the next one starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    rt = cpctl.init()
    if args.memory_report and rt.device.type != "cuda":
        raise SystemExit("--memory-report records the CUDA allocator: run with --device cuda")
    import peft
    import transformers

    timed = [(label, args.warmup, args.steps) for label in args.seqs.split(",") if label]
    probes = {system: args.probe if system == "cpctl" or args.plain_probe is None else args.plain_probe
              for system in args.systems}
    # A probe's two steps: the first makes the allocator's pools, cuDNN's plans and AdamW's state,
    # the second is timed; the peak is the larger of the two.
    lengths = {system: timed + [(label, 1, 1) for label in probes[system].split(",") if label]
               for system in args.systems}
    if not any(lengths.values()):
        raise SystemExit("no lengths: give --seqs or --probe")
    name = args.model.removeprefix(HF_PREFIX)
    shape = planner.PRESETS[name]
    longest = max(planner.parse_tokens(label) for entries in lengths.values() for label, _, _ in entries)
    # As `cpctl plan --lora-rank R --lora-targets all-linear --base-dtype bf16` sees this model.
    lora = planner.parse_lora(rank=str(args.lora_rank), targets=planner.ALL_LINEAR, base_dtype="bf16")
    for system in args.systems:
        if system == "plain" and rt.world_size > 1:  # it would train a whole replica on every GPU
            if rt.is_main:
                print(f"bench_lora: the plain system runs in one process; skipped at world {rt.world_size}", flush=True)
            continue
        if not lengths[system]:
            continue
        if system == "plain":
            bench = PlainLora(rt.device, shape, lora, max_seq=longest, alpha=args.lora_alpha)
        else:
            bench = CpctlLora(rt, shape, lora, max_seq=longest, alpha=args.lora_alpha, chunked_loss=args.chunked_loss)
            # The HF step keeps only the loss (model(labels=...).loss or the chunked one), not the logits.
            cpctl_setup = dataclasses.replace(planner.Setup.from_profile(rt.config, chunked_loss=args.chunked_loss),
                                              logits_kept=False, lora=lora)
        optimizer = torch.optim.AdamW([p for p in bench.model.parameters() if p.requires_grad], lr=1e-4)
        facts = dict(system=system, model=args.model, params=sum(p.numel() for p in bench.model.parameters()),
                     trainable=bench.trainable, lora=dict(rank=lora.rank, targets=list(lora.targets),
                                                          dropout=lora.dropout, base_dtype=lora.base_dtype),
                     lora_alpha=args.lora_alpha, base_dtypes=dtypes(bench.model, trained=False),
                     adapter_dtypes=dtypes(bench.model, trained=True), world=rt.world_size)
        if system == "cpctl":
            facts.update(cp=rt.cp_size, strategy=rt.config.parallelism.cp_comm_strategy)
        failed_at = None
        for index, (label, warmup, steps) in enumerate(lengths[system]):
            seq = planner.parse_tokens(label)
            if failed_at is not None and seq >= failed_at:
                if rt.is_main:
                    print(f"bench_lora: {system} at {label} not tried: {planner.format_tokens(failed_at)} "
                          "did not train", flush=True)
                continue
            record = dict(facts, seq=seq, probe=index >= len(timed),
                          gpu=torch.cuda.get_device_name() if rt.device.type == "cuda" else "cpu",
                          torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                          date=time.strftime("%Y-%m-%d"))
            try:
                last = system == "cpctl" and index == len(lengths[system]) - 1
                record.update(run_length(rt, bench, optimizer, seq, warmup=warmup, steps=steps,
                                         memory_report=args.memory_report if last else None))
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                record["error"] = "out of memory"
                failed_at = seq
            free_memory(rt.device)
            if rt.device.type != "cuda":  # run_length's CPU figure is the process's RSS, both systems' together
                record["peak_gib"] = None
            if system == "cpctl":
                # AdamW has no state before the first optimizer step, nor at the peak of a lone first step.
                setup = dataclasses.replace(cpctl_setup, first_step=index == 0 and warmup + steps == 1)
                if rt.selective_blocks is not None and setup.checkpoint_level == "mixed":
                    setup = dataclasses.replace(setup, selective_blocks=rt.selective_blocks)  # as the runtime applied
                planned = planner.estimate(shape, setup, seq)
                record.update({option: getattr(planned.setup, option) for option in RECORDED_OPTIONS},
                              plan_gib=round(planned.peak / planner.GiB, 2),
                              plan_host_gib=round(planned.host_bytes / planner.GiB, 2))
                if rt.host_arena is not None:
                    record["host_gib"] = round(rt.host_arena.peak_bytes / planner.GiB, 2)
            # The plain rows carry no planner options: their setup is the docstring's, not a profile's,
            # and tests/test_planner.py checks the plan against every row that has them.
            write_record(rt, record, args.out)
        del bench, optimizer
        free_memory(rt.device)

if __name__ == "__main__":
    main()
