"""`cpctl plan --calibrate`: a few seconds of the kernels a training step spends its time in, on this
machine's GPU (or CPU), as the Throughputs the step-time model reads.

The rest of the planner is arithmetic and never imports torch; this module does, when it runs. It
times what the runtime really calls: bf16 matmuls of a block's shapes, the engine's own attention
kernels (`attention/kernels.py`, cuDNN on an H100/H200) forward and backward at each head dim,
how much slower attention runs at 4x that length, the flash kernel that takes windows and documents,
an elementwise kernel over HBM, pinned copies each way, and torch's AdamW on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cpctl.planner.hardware import H200, HEAD_DIMS, Throughputs


def _timed(run: Callable[[], object], *, synchronize: Callable[[], None], repeats: int) -> float:
    """Median seconds of `run`, after one warm-up call."""
    run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _figures(value: float) -> float:
    """Three significant figures: what a calibration can tell apart run to run."""
    return float(f"{value:.3g}")


def calibrate(device: str = "cuda", *, dim: int = 4096, ffn_dim: int = 14336, small: bool = False) -> Throughputs:
    """Measure this machine's throughputs (`small`: tiny sizes, for a smoke test on CPU)."""
    import torch

    from cpctl.attention.kernels import (
        block_backward,
        block_forward,
        expand_kv,
        seq_major,
        window_backward,
        window_forward,
    )

    target = torch.device(device)
    cuda = target.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = 2 if small else 5
    tokens = 256 if small else 16384  # a matmul's rows
    length = 128 if small else 32768  # attention's calibrated length: a typical long step's
    if small:
        dim, ffn_dim = 64, 128

    def matmul_tflops() -> float:
        flops, seconds = 0.0, 0.0
        x = torch.randn(tokens, dim, device=target, dtype=dtype)
        for rows, cols in ((dim, ffn_dim), (ffn_dim, dim), (dim, dim)):
            weight = torch.randn(cols, rows, device=target, dtype=dtype)
            inputs = x if rows == dim else torch.randn(tokens, rows, device=target, dtype=dtype)
            seconds += _timed(lambda: inputs @ weight.t(), synchronize=synchronize, repeats=repeats)  # noqa: B023
            flops += 2 * tokens * rows * cols
        return flops / seconds / 1e12

    def attention_tflops(head_dim: int, length: int = length, *, windowed: bool = False, causal: bool = True,
                         repeats: int = repeats) -> tuple[float, float]:
        """Forward and backward TFLOP/s of the engine's dense kernel, causal or not (or of the windowed
        flash kernel with a window as long as the sequence: the causal pairs)."""
        heads, kv_heads = (2, 1) if small else (32, 8)  # GQA, as most long-context models have it

        def tensor(count: int) -> torch.Tensor:
            return seq_major(torch.randn(1, length, count, head_dim, device=target, dtype=dtype).transpose(1, 2))

        q, dout, k, v = tensor(heads), tensor(heads), tensor(kv_heads), tensor(kv_heads)
        scale = head_dim ** -0.5
        if windowed:  # the windowed flash call takes K/V with the q heads (the engine widens them first)
            k, v = expand_kv(k, heads // kv_heads), expand_kv(v, heads // kv_heads)

            def forward_call():
                return window_forward(q, k, v, left=length, right=0, scale=scale)

            def backward_call():
                return window_backward(dout, q, k, v, out, lse, left=length, right=0, scale=scale)
        else:
            def forward_call():
                return block_forward(q, k, v, causal=causal, scale=scale)

            def backward_call():
                return block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        out, lse = forward_call()
        forward = _timed(forward_call, synchronize=synchronize, repeats=repeats)
        backward = _timed(backward_call, synchronize=synchronize, repeats=repeats)
        flops = 4 * (length * (length + 1) / 2 if causal else length * length) * heads * head_dim
        return flops / forward / 1e12, 2.5 * flops / backward / 1e12

    def combined(rates: tuple[float, float]) -> float:
        """One forward and one backward's FLOPs over their time."""
        forward, backward = rates
        return (1 + 2.5) / (1 / forward + 2.5 / backward)

    def forward_falloff() -> dict[int, float]:
        """The share of the forward's rate lost per doubling of the length, from one call at 8x the
        calibrated length (head dims 64 and 128; the backward keeps its rate)."""
        if small:
            return {}
        lost = {}
        for dim in (64, 128):
            long = attention_tflops(dim, 8 * length, repeats=1)[0]
            lost[dim] = max(0.0, round((1 - long / forward[dim]) / 3, 3))
        return lost

    def rectangle_gain() -> float:
        """A non-causal call's rate over a causal one's (head dims 64 and 128)."""
        if small:
            return H200.rectangle_attention_gain
        gains = [combined(attention_tflops(dim, causal=False)) / combined((forward[dim], backward[dim])) for dim in (64, 128)]
        return round(sum(gains) / len(gains), 3)

    def masked_share() -> float:
        from cpctl.attention.kernels import windowed_flash_works

        if small or not windowed_flash_works(dtype, 128, target.index):
            return H200.masked_attention_share
        return round(combined(attention_tflops(128, windowed=True)) / combined((forward[128], backward[128])), 3)

    def hbm_gbps() -> float:
        n = 2**16 if small else 2**28
        a, b = torch.randn(n, device=target, dtype=dtype), torch.randn(n, device=target, dtype=dtype)
        out = torch.empty_like(a)
        seconds = _timed(lambda: torch.add(a, b, out=out), synchronize=synchronize, repeats=repeats)
        return 3 * n * a.element_size() / seconds / 1e9

    def pcie_gbps(memory_gbps: float) -> float:
        if not cuda:
            return memory_gbps  # on CPU "offloaded" tensors stay in the same memory
        n = 2**28  # 1 GiB of fp32 each way
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        gpu = torch.empty(n, dtype=torch.float32, device=target)
        there = _timed(lambda: gpu.copy_(host, non_blocking=True), synchronize=synchronize, repeats=repeats)
        back = _timed(lambda: host.copy_(gpu, non_blocking=True), synchronize=synchronize, repeats=repeats)
        return 2 * 4 * n / (there + back) / 1e9

    def expert_matmul_tflops() -> float | None:
        """torch._grouped_mm over 8 experts of a block's shapes, tokens spread evenly (None where torch has none)."""
        grouped = getattr(torch, "_grouped_mm", None)
        if grouped is None or not cuda or small:
            return None
        experts = 8
        x = torch.randn(tokens, dim, device=target, dtype=dtype)
        weight = torch.randn(experts, dim, ffn_dim, device=target, dtype=dtype)
        offsets = torch.arange(1, experts + 1, device=target, dtype=torch.int32) * (tokens // experts)
        try:
            seconds = _timed(lambda: grouped(x, weight, offs=offsets), synchronize=synchronize, repeats=repeats)
        except (RuntimeError, TypeError):  # a GPU or build whose grouped GEMM does not take these
            return None
        return _figures(2 * tokens * dim * ffn_dim / seconds / 1e12)

    def host_adam_params_per_s() -> float:
        """torch's AdamW as it steps parameters on the host (cpu_offload): its default, tensor by tensor,
        over more memory than the host's caches hold."""
        size, count = (2**10, 4) if small else (2**22, 16)
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
        for param in params:
            param.grad = torch.randn(size)
        optimizer = torch.optim.AdamW(params)
        return size * count / _timed(optimizer.step, synchronize=lambda: None, repeats=repeats)

    forward, backward = {}, {}
    for head_dim in HEAD_DIMS:
        forward[head_dim], backward[head_dim] = (_figures(rate) for rate in attention_tflops(head_dim))
    memory = hbm_gbps()
    name = torch.cuda.get_device_name(target) if cuda else "CPU"
    return Throughputs(
        name=name, source=f"calibrated on this machine ({name}, torch {torch.__version__}, "
                          f"{time.strftime('%Y-%m-%d')}): cpctl plan --calibrate",
        matmul_tflops=_figures(matmul_tflops()), attention_forward_tflops=forward,
        attention_backward_tflops=backward, hbm_gbps=_figures(memory), pcie_gbps=_figures(pcie_gbps(memory)),
        host_adam_params_per_s=_figures(host_adam_params_per_s()),
        nvlink_gbps=H200.nvlink_gbps, network_gbps=H200.network_gbps,
        attention_half_rate_tokens=H200.attention_half_rate_tokens, block_launch_s=H200.block_launch_s,
        attention_forward_falloff=forward_falloff(), attention_calibrated_keys=length,
        rectangle_attention_gain=rectangle_gain(), expert_dispatch_s=H200.expert_dispatch_s,
        masked_attention_share=masked_share(), expert_matmul_tflops=expert_matmul_tflops(),
    )
