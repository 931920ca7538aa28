"""A training script written for accelerate's context parallelism, as its guide writes one.

Nothing here knows cpctl: an `Accelerator()` that reads its parallel sizes from the environment
(what `accelerate launch` sets, and what `cpctl launch` sets for an accelerate script), FSDP2 through
`accelerator.prepare`, labels shifted by the script itself (`shift_labels`), and every step inside
`accelerator.maybe_context_parallel`. A tiny random Llama and random tokens: nothing is downloaded.

    python scripts/accelerate_cp.py                                   # one process, the reference
    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 \\
        scripts/accelerate_cp.py                                      # cp 2, cpctl's engine, gloo
    cpctl launch --cpu --num_processes 2 --parallelism_config_cp_size 2 \\
        scripts/accelerate_cp.py                                      # the same, in accelerate's flags
    cpctl launch --device cpu --nproc-per-node 4 --sp-size 2 \\
        scripts/accelerate_cp.py --sp-size 2                          # sp 2 x dp_shard 2: cpctl's Ulysses
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--sliding-window", type=int, default=None,
                   help="a Mistral with this sliding window instead of the Llama (accelerate's own path refuses it)")
    p.add_argument("--sp-size", type=int, default=None,
                   help="ParallelismConfig(sp_size=N), as a script for accelerate's (DeepSpeed) sequence parallelism "
                        "sets it; cpctl runs it on its Ulysses")
    p.add_argument("--losses-out", default=None, help="write the per-step losses here as JSON")
    return p.parse_args()


def batches(vocab_size: int, *, steps: int, batch: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Token batches with a learnable rule (each row counts up by its own stride), with labels and
    the shifted labels the guide asks the script to make."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        start = torch.randint(vocab_size, (batch, 1), generator=generator)
        stride = torch.randint(1, 4, (batch, 1), generator=generator)
        ids = (start + stride * torch.arange(seq_len)) % vocab_size
        shift_labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
        out.append({"input_ids": ids, "labels": ids.clone(), "shift_labels": shift_labels})
    return out


def main() -> None:
    args = parse_args()
    # ParallelismConfig() reads PARALLELISM_CONFIG_*; without them (plain python) it is one process.
    accelerator = Accelerator(parallelism_config=ParallelismConfig(sp_size=args.sp_size))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa", use_cache=False)
    if args.sliding_window:
        config = MistralConfig(**{**config.to_dict(), "model_type": "mistral", "sliding_window": args.sliding_window})
    model = (MistralForCausalLM if args.sliding_window else LlamaForCausalLM)(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    losses = []
    for batch in batches(config.vocab_size, steps=args.steps, batch=args.batch, seq_len=args.seq_len):
        batch = {name: tensor.to(accelerator.device) for name, tensor in batch.items()}
        buffers = [batch["input_ids"], batch["labels"], batch["shift_labels"]]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        local_tokens = batch["input_ids"].shape[1]  # sharded in place (not restored) under CP
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        accelerator.print(f"step {len(losses) - 1}  loss {losses[-1]:.6f}")
    if accelerator.is_main_process and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"losses": losses, "world": accelerator.num_processes, "local_tokens": local_tokens}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
