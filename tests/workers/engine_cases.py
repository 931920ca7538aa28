"""Worker: every CP attention case against single-process SDPA on the full sequence.

Run under torchrun (gloo on CPU, nccl on CUDA); rank 0 writes one JSON object per case,
with the max abs error of the output and of dq/dk/dv, to the file given as argv[1].
"""

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpctl.attention import ChunkLayout, Strategy, context_parallel_attention, shard, unshard
from cpctl.runtime.documents import place

STRATEGIES = tuple(strategy.value for strategy in Strategy)


def gather_full(local: torch.Tensor, layout: ChunkLayout, group) -> torch.Tensor:
    pieces = [torch.empty_like(local) for _ in range(layout.cp_size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, seq_dim=2, layout=layout)


def reference_mask(n, *, causal, window, chunk, documents, device, hidden=None):
    """None for plain attention; else the boolean mask as Hugging Face's mask functions define it
    ((n, n), or (batch, 1, n, n) with documents or hidden keys (padding) per row)."""
    if window is None and chunk is None and documents is None and hidden is None:
        return None
    q, k = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    allowed = (k <= q) if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if window is not None:
        allowed &= (k > q - window) if causal else ((q - k).abs() < window)
    if chunk is not None:
        allowed &= k // chunk == q // chunk
    if documents is None and hidden is None:
        return allowed
    rows = []
    for starts, ranges in zip(documents or [(0,)] * len(hidden), hidden or [None] * len(documents)):
        doc = torch.zeros(n, dtype=torch.long, device=device)
        for start in starts[1:]:
            doc[start:] += 1
        row = allowed & (doc[:, None] == doc[None, :])
        for h0, h1 in ranges or ():  # a 2-D attention_mask's zeros: keys no query sees
            row = row & ((k < h0) | (k >= h1))
        rows.append(row)
    return torch.stack(rows)[:, None]


def hidden_rows(pattern, seq, batch):
    """Padding (hidden key ranges) per row for a named pattern: as attention_mask zeros would give."""
    patterns = {
        "left": [((0, 5),), ((0, seq // 2 + 3),)],  # the second row's padding covers whole chunks (and ranks)
        "right": [((seq - 9, seq),), None],
        "holes": [((3, 4), (seq // 4, seq // 2 + 1)), ((0, 2), (seq - 1, seq))],
    }
    return patterns[pattern][:batch]


def document_rows(pattern, seq, batch):
    """Document starts per row for a named packing pattern."""
    patterns = {
        "one_token": (0, 1, 2, 3, 9, 10, seq - 1),  # one-token documents, the last token alone
        "spanning": (0, seq // 4 - 3, seq // 2 + 5, seq - 7),  # documents across chunk and rank boundaries
        "many_short": tuple(range(0, seq, 3)),
        "whole": (0,),
    }
    if pattern == "mixed_rows":  # each row packed its own way
        return [patterns["spanning"], patterns["one_token"]][:batch]
    return [patterns[pattern]] * batch


def run_case(*, strategy, causal, load_balance, q_heads, kv_heads, batch, seq, dtype, device, group,
             window=None, chunk=None, v_dim=None, documents=None, hidden=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = ChunkLayout(cp_size=world, cp_rank=rank, load_balance=load_balance)
    if documents is not None:
        documents = document_rows(documents, seq, batch)
        if load_balance:  # packed documents get the cost-balanced layout the runtime would pick
            layout = place(documents, seq_len=seq, cp_size=world, cp_rank=rank).layout
    if hidden is not None:
        hidden = hidden_rows(hidden, seq, batch)
    gen = torch.Generator().manual_seed(1234)
    head_dim = 16 if device.type == "cpu" else 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    v_dim = v_dim or head_dim
    q, dout = rand(batch, q_heads, seq, head_dim), rand(batch, q_heads, seq, v_dim)
    k, v = rand(batch, kv_heads, seq, head_dim), rand(batch, kv_heads, seq, v_dim)
    ref_dtype = torch.promote_types(dtype, torch.float32)  # reference in fp32 (fp64 for fp64)
    ref_inputs = [t.detach().to(ref_dtype).clone().requires_grad_() for t in (q, k, v)]
    mask = reference_mask(seq, causal=causal, window=window, chunk=chunk, documents=documents, device=device,
                          hidden=hidden)
    ref = F.scaled_dot_product_attention(*ref_inputs, attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=kv_heads != q_heads)
    ref.backward(dout.to(ref_dtype))

    local = [shard(t, seq_dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group=group, layout=layout, strategy=strategy,
                                     is_causal=causal, enable_gqa=kv_heads != q_heads, window=window, chunk=chunk,
                                     documents=documents, hidden_keys=hidden)
    out.backward(shard(dout, seq_dim=2, layout=layout))
    results = {"out": gather_full(out.detach(), layout, group)}
    for name, tensor in zip("qkv", local):
        results[f"d{name}"] = gather_full(tensor.grad, layout, group)
    expected = {"out": ref.detach(), "dq": ref_inputs[0].grad, "dk": ref_inputs[1].grad, "dv": ref_inputs[2].grad}
    errors = {name: (results[name].to(ref_dtype) - expected[name]).abs().max().item() for name in expected}
    if dtype in (torch.float32, torch.float64):
        return errors, None
    # In low precision, also single-process SDPA in the same dtype: its own distance from fp32,
    # and cpctl's distance from it (the engine's bf16 bar: <= 2e-2).
    same_dtype = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*same_dtype, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=kv_heads != q_heads)
    sdpa.backward(dout)
    single = {"out": sdpa.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", same_dtype)}}
    return errors, {
        "sdpa_vs_fp32": {name: (single[name].float() - expected[name].float()).abs().max().item() for name in expected},
        "cpctl_vs_sdpa": {name: (results[name].float() - single[name].float()).abs().max().item() for name in expected},
    }


def main():
    output = sys.argv[1]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    started_here = not dist.is_initialized()  # in tests/pool.py's processes the group is the pool's
    if started_here:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtypes = [torch.float32] if device_type == "cpu" else [torch.bfloat16]
    world = dist.get_world_size()
    records = []
    for strategy, causal, load_balance, (q_heads, kv_heads), batch, dtype in itertools.product(
        STRATEGIES, (True, False), (True, False), ((4, 4), (4, 2), (4, 1)), (1, 2), dtypes
    ):
        seq = 16 * world * 2
        errors, sdpa_errors = run_case(strategy=strategy, causal=causal, load_balance=load_balance, q_heads=q_heads,
                          kv_heads=kv_heads, batch=batch, seq=seq, dtype=dtype, device=device, group=dist.group.WORLD)
        records.append(dict(world=world, strategy=strategy, causal=causal, load_balance=load_balance,
                            q_heads=q_heads, kv_heads=kv_heads, batch=batch, seq=seq,
                            dtype=str(dtype).removeprefix("torch."), errors=errors, sdpa_errors=sdpa_errors))
    # Windows and chunks cut through shards (chunks of 16 tokens), value heads wider or
    # narrower than q/k (MLA), fp64: one case each per strategy and balance.
    extras = [dict(window=w) for w in (1, 7, 16, 24, 40, 1000)] + [dict(chunk=c) for c in (5, 16, 24, 40)]
    extras += [dict(window=10, chunk=24), dict(v_dim=8), dict(v_dim=24), dict(dtype=torch.float64),
               dict(dtype=torch.float64, window=24)]
    extras += [dict(documents=d) for d in ("one_token", "spanning", "many_short", "whole", "mixed_rows")]
    extras += [dict(documents="spanning", window=6)]
    extras += [dict(hidden=h) for h in ("left", "right", "holes")] + [dict(hidden="left", documents="spanning"),
                                                                      dict(hidden="holes", window=7)]
    if device_type == "cuda":
        extras = [e for e in extras if e.get("dtype") != torch.float64]
    for strategy, causal, load_balance, extra in itertools.product(STRATEGIES, (True, False), (True, False), extras):
        dtype = extra.get("dtype", dtypes[0])
        options = {k: v for k, v in extra.items() if k != "dtype"}
        seq = 16 * world * 2
        errors, sdpa_errors = run_case(strategy=strategy, causal=causal, load_balance=load_balance, q_heads=4,
                                       kv_heads=2, batch=2, seq=seq, dtype=dtype, device=device,
                                       group=dist.group.WORLD, **options)
        records.append(dict(world=world, strategy=strategy, causal=causal, load_balance=load_balance, q_heads=4,
                            kv_heads=2, batch=2, seq=seq, dtype=str(dtype).removeprefix("torch."), errors=errors,
                            sdpa_errors=sdpa_errors, **options))
    if dist.get_rank() == 0:
        with open(output, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    # every rank done before any tears gloo down: a rank leaving first aborts its peers' pending pair threads
    dist.barrier()
    if started_here:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
