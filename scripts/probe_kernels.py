"""Which LSE-returning CUDA attention kernels work here, checked against autograd SDPA, and
whether the flash kernel's window computes a sliding window's band (else: why not).

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
