"""Which LSE-returning CUDA attention kernels work here, checked against autograd SDPA, whether
the flash kernel's window computes a sliding window's band (else: why not), which kernels take
GQA's K/V at their own heads, and how much each backward allocates beyond its gradients.

    python scripts/probe_kernels.py
"""

import torch

from cpctl.attention import kernels

for name in kernels.CUDA_PREFERENCE:
    with kernels.pinned_kernel(name):
        for dtype in (torch.bfloat16, torch.float16):
            try:
                print(name, dtype, "ok:", kernels.kernel_for(torch.empty(1, 1, 1, 128, device="cuda", dtype=dtype)).name)
            except RuntimeError as exc:
                print(name, dtype, "FAILED:", exc)
print("automatic choice:", kernels.kernel_for(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)).name)
for dtype in (torch.bfloat16, torch.float16):
    problem = kernels.windowed_flash_problem(dtype, 128, torch.cuda.current_device())
    print("windowed flash", dtype, "ok" if problem is None else f"FAILED: {problem}")

# GQA at K/V's own heads (kernels.takes_gqa), and what each kernel's backward allocates beyond its
# inputs and its gradients, in fp32 copies of q: `cpctl plan` counts the one-call workspace from it.
# Shapes: the Llama-3.2-1B's heads (32 q, 8 K/V, 64), Llama-3.1-8B's (32, 8, 128), and the 8B's heads
# on one rank of Ulysses over 8 GPUs (4, 1, 128).
SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128), "8b/sp8": (4, 1, 128), "8b/sp8 mha": (4, 4, 128)}
device = torch.device("cuda", torch.cuda.current_device())
for name in kernels.CUDA_PREFERENCE:
    kernel = kernels.KERNELS[name]
    print(name, "takes GQA itself (4 q heads to a K/V head):", kernels.takes_gqa(kernel, torch.bfloat16, 128, device, 4))
    with kernels.pinned_kernel(name):
        for label, (heads, kv_heads, head_dim) in SHAPES.items():
            seq = 128 * 1024
            q, out, dout = (torch.randn(1, seq, heads, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                            for _ in range(3))
            k, v = (torch.randn(1, seq, kv_heads, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                    for _ in range(2))
            with torch.no_grad():
                out, lse = kernels.block_forward(q, k, v, causal=True, scale=head_dim**-0.5)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                try:
                    grads = kernels.block_backward(dout, q, k, v, out, lse, causal=True, scale=head_dim**-0.5)
                except RuntimeError as exc:
                    print(f"  {label}: {str(exc).splitlines()[0]}")
                    continue
                torch.cuda.synchronize()
            results = sum(g.untyped_storage().nbytes() for g in grads)
            beyond = torch.cuda.max_memory_allocated() - before - results
            print(f"  {label} ({heads} q heads, {kv_heads} K/V, {head_dim}), {seq} tokens: backward allocates "
                  f"{beyond / 2**20:.0f} MiB beyond its gradients = {beyond / (4 * q.numel()):.2f} fp32 copies of q")
            del q, k, v, out, dout, grads, lse
            torch.cuda.empty_cache()
