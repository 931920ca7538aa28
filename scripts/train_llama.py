"""Train a small Llama on synthetic sequences with cpctl: the example that README's first command runs.

    cpctl launch --profile cpu-try scripts/train_llama.py --steps 5          # 2 CPU processes, cp 2
    python scripts/train_llama.py --steps 5                                 # one process, no CP
    cpctl launch --nproc-per-node 2 --cp-size 2 scripts/train_llama.py --preset 1b --seq-len 65536 --steps 20

Every rank of a CP group gets the same sequences and keeps 1/cp of their tokens; the loss
printed is the token mean of the whole step's batch. `--losses-out FILE` writes the losses
(rank 0) as JSON, which the tests compare between CP and non-CP runs.

With `--checkpoint-dir DIR --save-every N` it saves a checkpoint every N steps and, started
again (by hand, or by torchrun after a failure with `max_restarts`), resumes from the newest:

    cpctl launch --profile cpu-try --max-restarts 1 scripts/train_llama.py --steps 20 \
        --checkpoint-dir runs/ckpt --save-every 5
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.nn.functional as F

import cpctl
from cpctl.runtime.losses import chunked_linear_cross_entropy
from llama import PRESETS, Llama, SyntheticSequences, tp_plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=2, help="sequences per step over all dp ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--losses-out", default=None)
    p.add_argument("--checkpoint-dir", default=None, help="save here, and resume from the newest checkpoint here")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--chunked-loss", action="store_true", help="never hold the full logits (memory.loss_chunk_tokens)")
    p.add_argument("--stop-after", type=int, default=None, help="end after this many steps of the schedule "
                   "(--steps still sets the data and schedule), e.g. to resume later")
    return p.parse_args(argv)


def train_step(rt, model, optimizer, input_ids: torch.Tensor, *, chunked_loss: bool = False) -> torch.Tensor:
    """One optimizer step on a (batch, seq) batch of full sequences; returns the global mean loss.

    With `chunked_loss` the loss is taken from the final hidden states and the head's weight a
    chunk of tokens at a time (memory.loss_chunk_tokens): the full logits never exist."""
    ids = input_ids.to(rt.device)
    labels = cpctl.shift_labels(ids)
    pos = cpctl.position_ids_like(ids)
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        if chunked_loss:
            hidden = model(ids, position_ids=pos, hidden_only=True)
            loss_sum = chunked_linear_cross_entropy(hidden, model.head.weight, labels,
                                                    chunk_tokens=rt.config.memory.loss_chunk_tokens)
        else:
            logits = model(ids, position_ids=pos)
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                       reduction="sum")
        loss = rt.token_mean(loss_sum, labels)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    if device.type == "cuda":
        return "peak GPU memory", torch.cuda.max_memory_allocated(device) / 2**30
    return "peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv=None):
    args = parse_args(argv)
    rt = cpctl.init()
    if args.global_batch % rt.dp_size:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the dp size {rt.dp_size}")
    cfg = PRESETS[args.preset]
    if rt.is_main:  # a large preset takes a while to build and shard: say what is happening
        print(f"cpctl: building the {args.preset} model and sharding it over {rt.world_size} ranks ...", flush=True)
    built = time.perf_counter()
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every layout
    model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = rt.prepare_model(model, tp_plan=tp_plan() if rt.config.parallelism.tp_size > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = SyntheticSequences(length=args.steps * args.global_batch, seq_len=args.seq_len,
                              vocab_size=cfg.vocab_size, seed=args.seed)
    loader = rt.prepare_dataloader(data, batch_size=args.global_batch // rt.dp_size, shuffle=False)
    if rt.is_main:
        print(f"cpctl: world {rt.world_size} (dp {rt.dp_size} x cp {rt.cp_size}), {rt.config.parallelism.cp_comm_strategy}, "
              f"device {rt.device.type}, {n_params:,} parameters (ready in {time.perf_counter() - built:.1f} s); "
              f"{args.steps} steps of {args.global_batch} x {args.seq_len} tokens",
              flush=True)
    checkpoints = cpctl.Checkpointer(args.checkpoint_dir, async_save=args.async_save) if args.checkpoint_dir else None
    loading = time.perf_counter()
    first = checkpoints.load_latest(model=model, optimizer=optimizer, loader=loader) if checkpoints else 0
    if first and rt.is_main:
        print(f"cpctl: resumed from the checkpoint of step {first} in {args.checkpoint_dir} "
              f"({time.perf_counter() - loading:.1f} s)", flush=True)
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(loader, start=first):
        step_start = time.perf_counter()
        loss = train_step(rt, model, optimizer, batch["input_ids"], chunked_loss=args.chunked_loss).item()
        losses.append(loss)
        seconds = time.perf_counter() - step_start
        tokens_per_s = args.global_batch * args.seq_len / seconds
        if rt.is_main:
            label, peak = peak_memory_gib(rt.device)
            print(f"step {step:3d}  loss {loss:.4f}  {seconds:.2f} s  {tokens_per_s:,.0f} tokens/s  "
                  f"{label} {peak:.2f} GiB", flush=True)
        if checkpoints and args.save_every and (step + 1) % args.save_every == 0:
            saving = time.perf_counter()
            checkpoints.save(step + 1, model=model, optimizer=optimizer, loader=loader)
            if rt.is_main:
                print(f"cpctl: checkpoint of step {step + 1} {'handed to the writer' if args.async_save else 'saved'} "
                      f"in {time.perf_counter() - saving:.1f} s", flush=True)
        if args.stop_after is not None and step + 1 >= args.stop_after:
            break
    if checkpoints:
        checkpoints.wait()  # an asynchronous save still in flight
    elapsed = time.perf_counter() - start
    label, peak = peak_memory_gib(rt.device)
    print(f"rank {rt.rank}: {label} {peak:.2f} GiB; {len(losses) * args.global_batch * args.seq_len / elapsed:,.0f} "
          f"tokens/s overall", flush=True)
    if rt.is_main and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"losses": losses, "first_step": first, "world": rt.world_size, "cp": rt.cp_size,
                       "dp": rt.dp_size}, f)


if __name__ == "__main__":
    main()
