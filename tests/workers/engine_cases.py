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

from cpctl.attention import ChunkLayout, context_parallel_attention, shard, unshard


def gather_full(local: torch.Tensor, layout: ChunkLayout, group) -> torch.Tensor:
    pieces = [torch.empty_like(local) for _ in range(layout.cp_size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, seq_dim=2, layout=layout)


def run_case(*, strategy, causal, load_balance, q_heads, kv_heads, batch, seq, dtype, device, group):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = ChunkLayout(cp_size=world, cp_rank=rank, load_balance=load_balance)
    gen = torch.Generator().manual_seed(1234)
    head_dim = 16 if device.type == "cpu" else 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, dout = rand(batch, q_heads, seq, head_dim), rand(batch, q_heads, seq, head_dim)
    k, v = rand(batch, kv_heads, seq, head_dim), rand(batch, kv_heads, seq, head_dim)
    ref_inputs = [t.detach().float().clone().requires_grad_() for t in (q, k, v)]  # reference in fp32
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=causal, enable_gqa=kv_heads != q_heads)
    ref.backward(dout.float())

    local = [shard(t, seq_dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group=group, layout=layout, strategy=strategy,
                                     is_causal=causal, enable_gqa=kv_heads != q_heads)
    out.backward(shard(dout, seq_dim=2, layout=layout))
    results = {"out": gather_full(out.detach(), layout, group)}
    for name, tensor in zip("qkv", local):
        results[f"d{name}"] = gather_full(tensor.grad, layout, group)
    expected = {"out": ref.detach(), "dq": ref_inputs[0].grad, "dk": ref_inputs[1].grad, "dv": ref_inputs[2].grad}
    errors = {name: (results[name].float() - expected[name].float()).abs().max().item() for name in expected}
    if dtype == torch.float32:
        return errors, None
    # In low precision, also single-process SDPA in the same dtype: its own distance from fp32,
    # and cpctl's distance from it (SPEC's bar: <= 2e-2 in bf16).
    same_dtype = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*same_dtype, is_causal=causal, enable_gqa=kv_heads != q_heads)
    sdpa.backward(dout)
    single = {"out": sdpa.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", same_dtype)}}
    return errors, {
        "sdpa_vs_fp32": {name: (single[name].float() - expected[name].float()).abs().max().item() for name in expected},
        "cpctl_vs_sdpa": {name: (results[name].float() - single[name].float()).abs().max().item() for name in expected},
    }


def main():
    output = sys.argv[1]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtypes = [torch.float32] if device_type == "cpu" else [torch.bfloat16]
    world = dist.get_world_size()
    records = []
    for strategy, causal, load_balance, (q_heads, kv_heads), batch, dtype in itertools.product(
        ("allgather", "alltoall"), (True, False), (True, False), ((4, 4), (4, 2), (4, 1)), (1, 2), dtypes
    ):
        seq = 16 * world * 2
        errors, sdpa_errors = run_case(strategy=strategy, causal=causal, load_balance=load_balance, q_heads=q_heads,
                          kv_heads=kv_heads, batch=batch, seq=seq, dtype=dtype, device=device, group=dist.group.WORLD)
        records.append(dict(world=world, strategy=strategy, causal=causal, load_balance=load_balance,
                            q_heads=q_heads, kv_heads=kv_heads, batch=batch, seq=seq,
                            dtype=str(dtype).removeprefix("torch."), errors=errors, sdpa_errors=sdpa_errors))
    if dist.get_rank() == 0:
        with open(output, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
