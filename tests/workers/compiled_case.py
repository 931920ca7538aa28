"""Two training steps of a tiny Hugging Face Llama, compiled with torch.compile after
rt.prepare_model or not (`--compile`); rank 0 writes the losses to OUT as JSON.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/compiled_case.py OUT [--compile]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cpctl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    rt = cpctl.init()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = rt.prepare_model(LlamaForCausalLM(config))
    model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(2):
        ids = torch.randint(64, (1, 32), generator=generator)
        labels, pos = cpctl.shift_labels(ids), cpctl.position_ids_like(ids)
        with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                       no_restore_buffers={ids, labels, pos}):
            logits = model(input_ids=ids, position_ids=pos).logits
            loss = rt.token_mean(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                                   reduction="sum"), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if rt.is_main:
        args.out.write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
