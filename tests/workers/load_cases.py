"""Load a local bf16 checkpoint two ways and train each two steps: `rt.from_pretrained` (meta
build, each rank reads its shards) and the way before it (`from_pretrained` on every rank, then
`rt.prepare_model`). Rank 0 writes what the test compares (OUT as JSON): the loaded weights
against the checkpoint's (bit-equal expected), dtypes, buffers, and both ways' losses.

    python tests/workers/load_cases.py CHECKPOINT OUT                         # one process
    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/load_cases.py CHECKPOINT OUT
    python tests/workers/load_cases.py CHECKPOINT OUT --write-checkpoint [--tied]   # make CHECKPOINT first
    cpctl launch ... --script-api accelerate tests/workers/load_cases.py CHECKPOINT OUT --accelerate

`--accelerate`: an accelerate script's way (`from_pretrained` on every rank, then
`accelerator.prepare`, where only rank 0 reads and accelerate sends the shards); OUT gets the
loaded weights against the checkpoint's, which ranks read it, and two steps' losses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

SEQ, VOCAB = 32, 64


def write_checkpoint(path: Path, *, tied: bool) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, use_cache=False)
    # bf16 and in several files, as released checkpoints are
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="30KB")


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.clone() for name, tensor in full.items()}  # on a CPU they may be the parameters themselves


def train(rt, model: torch.nn.Module) -> list[float]:
    import cpctl

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        ids = torch.randint(VOCAB, (1, SEQ), generator=generator).to(rt.device)
        labels, pos = cpctl.shift_labels(ids), cpctl.position_ids_like(ids)
        with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                       no_restore_buffers={ids, labels, pos}):
            logits = model(input_ids=ids, position_ids=pos).logits
            loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            loss = rt.token_mean(loss_sum, labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def accelerate_way(checkpoint: Path, out: Path, *, call_before_prepare: bool = False, tie: bool = False) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa",
                                                 **({"tie_word_embeddings": True} if tie else {}))
    if call_before_prepare:  # the mistake: rank 1 holds no weights yet
        model(input_ids=torch.zeros(1, SEQ, dtype=torch.long))
    stored = stored_weights(checkpoint)  # from the files: from_pretrained on rank 1 would read nothing
    read = all(torch.equal(tensor, stored[name]) for name, tensor in model.state_dict().items() if name in stored)
    readers = [read]
    if accelerator.num_processes > 1:
        readers = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(readers, read)
    if accelerator.num_processes == 1:
        model.float()  # the reference: one plain process training the fp32 weights cpctl's runs keep
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    weights = {name: tensor.clone() for name, tensor in accelerator.get_state_dict(model).items()}
    losses = train_steps(accelerator, model, optimizer)
    if accelerator.is_main_process:
        want = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
        out.write_text(json.dumps({
            "names_differ": sorted(set(weights) ^ set(want)),
            "largest_weight_difference": max((weights[k] - want[k]).abs().max().item() for k in want),
            "dtypes": sorted({str(tensor.dtype) for tensor in weights.values()}),
            "ranks_that_read_the_weights": [rank for rank, did in enumerate(readers) if did], "losses": losses}))


def stored_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights |= load_file(file)
    return weights


def train_steps(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """Two steps of the guide's loop: every rank's weights must be the checkpoint's for one process's losses."""
    model.train()
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        ids = torch.randint(VOCAB, (1, SEQ), generator=generator).to(accelerator.device)
        with accelerator.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--write-checkpoint", action="store_true")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--call-before-prepare", action="store_true", help="--accelerate: call the model first")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="--accelerate: load with the head tied")
    args = parser.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.checkpoint, tied=args.tied)
        return
    if args.accelerate:
        accelerate_way(args.checkpoint, args.out, call_before_prepare=args.call_before_prepare,
                       tie=args.tie_word_embeddings)
        return
    import cpctl

    rt = cpctl.init()
    loaded = rt.from_pretrained(AutoModelForCausalLM, args.checkpoint, attn_implementation="sdpa")
    mode_after_loading = "eval" if not loaded.training else "train"
    weights = full_weights(loaded)
    buffers = {name: buffer.clone() for name, buffer in loaded.named_buffers()}
    loaded_losses = train(rt, loaded)
    before = rt.prepare_model(AutoModelForCausalLM.from_pretrained(args.checkpoint, attn_implementation="sdpa"))
    before_losses = train(rt, before)
    if not rt.is_main:
        return
    stored = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)  # bf16 values, exactly in fp32
    want = stored.state_dict()
    want_buffers = dict(stored.named_buffers())
    result = {
        "names_differ": sorted(set(weights) ^ set(want)),
        "largest_weight_difference": max((weights[k] - want[k]).abs().max().item() for k in want),
        "dtypes": sorted({str(tensor.dtype) for tensor in weights.values()}),
        "largest_buffer_difference": max((buffers[k].cpu() - want_buffers[k]).abs().max().item() for k in want_buffers),
        "mode_after_loading": mode_after_loading,
        "losses": loaded_losses, "losses_loaded_the_old_way": before_losses,
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
