"""Packed documents at cp_size 1 against a dense step of as many tokens: one GPU, one run.

An unmodified Hugging Face `LlamaForCausalLM` with Llama-3.2-1B's shape and vocabulary
(128,256), random weights, bf16 (FSDP2 mixed precision), AdamW, activation checkpointing, the
loss from `rt.causal_lm_loss` (the logits never whole). Two kinds of step over the same number
of tokens are timed side by side in one process:

* dense: one causal sequence;
* packed: the same length in documents of `--document` tokens (position ids restarting at each,
  given to `maybe_context_parallel(documents=...)` and to the model), attention inside each.

Both run at cp_size 1, through cpctl's engine (the packed step skips the blocks across
documents; no sequence-squared mask is built). Before timing, the engine's packed attention
(uneven documents, GQA) is checked against SDPA run document by document on this device.

    PYTHONPATH=. python scripts/bench_packed.py               # one H200: 128k tokens, 16 documents of 8k
    PYTHONPATH=. python scripts/bench_packed.py --tiny        # a CPU smoke run: a tiny model, 1k tokens

One JSON line per kind of step (step_s: median of --steps after --warmup; tokens_per_s; peak_gib),
then one with `packed_over_dense`, the packed step's time over the dense one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import cpctl
from cpctl import planner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import HF_PREFIX, HuggingFaceLlama  # noqa: E402
from train_llama import peak_memory_gib  # noqa: E402

TINY = planner.ModelShape("tiny-hf", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                          head_dim=16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hf:llama-3.2-1b", help="hf:<a shape cpctl plan knows>")
    p.add_argument("--seq", default="128k", help="tokens per step")
    p.add_argument("--document", default="8k", help="tokens per packed document")
    p.add_argument("--tiny", action="store_true", help="a tiny model, 1k tokens in documents of 128 (CPU smoke run)")
    p.add_argument("--checkpoint-level", choices=("full", "selective"), default="full")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.document = "1k", "128"
    name = args.model.removeprefix(HF_PREFIX)
    if not args.model.startswith(HF_PREFIX) or name not in planner.PRESETS:
        p.error(f"--model {args.model}: not hf:<a shape cpctl plan knows>")
    args.seq_len, args.document_len = planner.parse_tokens(args.seq), planner.parse_tokens(args.document)
    if args.seq_len % args.document_len:
        p.error(f"--seq {args.seq} is not a whole number of --document {args.document} documents")
    return args


def check_packed_attention(rt, *, seq: int, dtype: torch.dtype) -> float:
    """The engine's causal attention over uneven packed documents (fwd + bwd) against SDPA per
    document in fp64; returns the largest error over the output and the q/k/v gradients, each
    relative to its tensor's largest magnitude."""
    gen = torch.Generator().manual_seed(0)
    lengths = [seq // 4 - 3, seq // 2 + 7, seq - (seq // 4 - 3) - (seq // 2 + 7)]  # cut through any tiling
    q, k, v, dout = (torch.randn(1, heads, seq, 64, generator=gen).to(rt.device)
                     for heads in (8, 2, 2, 8))
    inputs = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    out = rt.attention(*inputs, is_causal=True, enable_gqa=True, documents=[starts])
    out.backward(dout.to(dtype))
    reference = [t.double().detach().requires_grad_() for t in (q, k, v)]
    pieces = [F.scaled_dot_product_attention(reference[0][:, :, a:b], reference[1][:, :, a:b],
                                             reference[2][:, :, a:b], is_causal=True, enable_gqa=True)
              for a, b in zip(starts, [*starts[1:], seq])]
    expected = torch.cat(pieces, dim=2)
    expected.backward(dout.double())
    return max((got.detach().double() - want.detach()).abs().max().item() / want.abs().max().item()
               for got, want in zip([out, *(t.grad for t in inputs)], [expected, *(t.grad for t in reference)]))


def packed_batch(ids: torch.Tensor, document: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids restarting every `document` tokens, and labels that predict no document's first token."""
    seq = ids.shape[1]
    pos = cpctl.position_ids_for_documents([[document] * (seq // document)], device=ids.device)
    labels = ids.clone()
    labels[:, document::document] = -100  # transformers shifts: the token before a start predicts nothing
    return pos, labels


def step(rt, model, optimizer, ids: torch.Tensor, *, document: int | None) -> float:
    ids = ids.clone()
    if document is None:
        pos, labels, packed = cpctl.position_ids_like(ids), ids.clone(), {}
    else:
        pos, labels = packed_batch(ids, document)
        packed = {"documents": pos.clone()}
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}, **packed):
        loss = rt.causal_lm_loss(model, input_ids=ids, labels=labels, position_ids=pos)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def timed(rt, model, optimizer, ids: torch.Tensor, *, document: int | None, warmup: int, steps: int) -> dict:
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step(rt, model, optimizer, ids, document=document))
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return dict(step_s=round(step_s, 3), tokens_per_s=round(ids.shape[1] / step_s),
                peak_gib=round(peak_memory_gib(rt.device)[1], 2), loss=round(losses[-1], 4))


def main(argv=None) -> None:
    args = parse_args(argv)
    rt = cpctl.init(activation_checkpointing=True, checkpoint_level=args.checkpoint_level)
    if rt.world_size != 1:
        raise SystemExit("bench_packed.py times one GPU (cp_size 1): run it with plain python")
    shape = TINY if args.tiny else planner.PRESETS[args.model.removeprefix(HF_PREFIX)]
    dtype = torch.bfloat16 if rt.device.type == "cuda" else torch.float32
    error = check_packed_attention(rt, seq=512 if args.tiny else 8192, dtype=dtype)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # relative: a few bf16 roundings
    if error > tolerance:
        raise SystemExit(f"packed attention differs from SDPA per document by {error:.3g} (> {tolerance}) here")
    bench = HuggingFaceLlama(rt, shape, max_seq=args.seq_len, chunked_loss=True)
    optimizer = torch.optim.AdamW(bench.model.parameters(), lr=1e-5)
    ids = torch.randint(shape.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0)).to(rt.device)
    common = dict(model=shape.name, params=sum(p.numel() for p in bench.model.parameters()), seq=args.seq_len,
                  checkpoint_level=args.checkpoint_level, loss_chunk_tokens=rt.config.memory.loss_chunk_tokens,
                  attention_check=float(f"{error:.3g}"), gpu=torch.cuda.get_device_name() if rt.device.type == "cuda"
                  else "cpu", torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    records = []
    for kind, document in (("dense", None), ("packed", args.document_len)):
        record = dict(kind=kind, documents=1 if document is None else args.seq_len // document,
                      document=document or args.seq_len, **common)
        record.update(timed(rt, bench.model, optimizer, ids, document=document, warmup=args.warmup, steps=args.steps))
        records.append(record)
    ratio = dict(kind="ratio", seq=args.seq_len, document=args.document_len,
                 packed_over_dense=round(records[1]["step_s"] / records[0]["step_s"], 3))
    for record in [*records, ratio]:
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
