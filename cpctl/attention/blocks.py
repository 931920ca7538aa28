"""Running a plan of blocks: forward with exact log-sum-exp merging, backward into gradient buffers.

All (B, H, S, D) tensors here are seq-major views (see `kernels.seq_major`), so a block's
rows are a dense slice that the kernels read in place.
"""

from __future__ import annotations

import torch

from cpctl.attention.kernels import block_backward, block_forward
from cpctl.attention.plan import Block


class ForwardAccumulator:
    """Partial attention results of one rank's queries, merged exactly with their LSE.

    Merging in fp32: new_lse = logaddexp(lse, lse_b); out = out * e^(lse - new) + out_b * e^(lse_b - new).
    `logaddexp` is stable where the naive log(1 + exp(.)) overflows. A row's first block
    is copied, not merged.
    """

    def __init__(self, q: torch.Tensor, *, chunk_len: int, num_chunks: int):
        self.out = empty_seq_major(q.shape, like=q)
        self.lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.chunk_len = chunk_len
        self.written = [False] * num_chunks

    def add(self, block: Block, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        rows = slice(block.q_start * self.chunk_len, block.q_stop * self.chunk_len)
        chunks = range(block.q_start, block.q_stop)
        fresh = [not self.written[c] for c in chunks]
        if all(fresh):
            self.out[:, :, rows].copy_(out_b)
            self.lse[:, :, rows].copy_(lse_b)
        elif any(fresh):  # plans never mix fresh and written rows in one block
            raise AssertionError(f"block {block} covers both merged and unwritten rows")
        else:
            out, lse = self.out[:, :, rows], self.lse[:, :, rows]
            new_lse = torch.logaddexp(lse, lse_b)
            out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
            out.add_(out_b * torch.exp(lse_b - new_lse).unsqueeze(-1))
            lse.copy_(new_lse)
        for c in chunks:
            self.written[c] = True

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not all(self.written):
            raise AssertionError("CP attention plan left query rows uncomputed")
        return self.out.to(dtype), self.lse


def forward_blocks(acc: ForwardAccumulator, blocks: list[Block], q, k, v, *, scale: float) -> None:
    c = acc.chunk_len
    for blk in blocks:
        kv_rows = slice(blk.kv_start * c, blk.kv_stop * c)
        out_b, lse_b = block_forward(
            q[:, :, blk.q_start * c: blk.q_stop * c], k[:, :, kv_rows], v[:, :, kv_rows],
            causal=blk.causal, scale=scale,
        )
        acc.add(blk, out_b, lse_b)


class ChunkSink:
    """Where gradients of a chunked buffer go: a chunk's first block copies, later ones add.

    `targets(chunk)` returns the views (dq; or dk and dv) that hold one chunk's gradient,
    so a gradient can land straight in a communication buffer laid out in another order.
    Copying the first write saves zero-filling and a read of every buffer.
    """

    def __init__(self, targets, *, num_chunks: int, chunk_len: int):
        self.targets = targets
        self.chunk_len = chunk_len
        self.written = [False] * num_chunks

    def add(self, first_chunk: int, *grads: torch.Tensor) -> None:
        c = self.chunk_len
        for offset in range(grads[0].shape[-2] // c):
            chunk = first_chunk + offset
            for target, grad in zip(self.targets(chunk), grads):
                part = grad[..., offset * c:(offset + 1) * c, :]
                if self.written[chunk]:
                    target.add_(part)
                else:
                    target.copy_(part)
            self.written[chunk] = True

    def zero_unwritten(self) -> None:
        for chunk, written in enumerate(self.written):
            if not written:
                for target in self.targets(chunk):
                    target.zero_()
            self.written[chunk] = True


def seq_chunks(*buffers: torch.Tensor, chunk_len: int):
    """Chunk -> views of each (..., S, D) buffer: the usual target of a ChunkSink."""
    return lambda chunk: tuple(buf[..., chunk * chunk_len:(chunk + 1) * chunk_len, :] for buf in buffers)


def backward_blocks(
    blocks: list[Block], *, dout, q, k, v, out, lse, dq: ChunkSink, dkv: ChunkSink, chunk_len: int, scale: float,
) -> None:
    """Each block's gradients: dq into the local queries' sink, dk/dv into the K/V buffer's sink."""
    c = chunk_len
    for blk in blocks:
        rows = slice(blk.q_start * c, blk.q_stop * c)
        kv_rows = slice(blk.kv_start * c, blk.kv_stop * c)
        dq_b, dk_b, dv_b = block_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows], out[:, :, rows],
            lse[:, :, rows].contiguous(), causal=blk.causal, scale=scale,
        )
        dq.add(blk.q_start, dq_b)
        dkv.add(blk.kv_start, dk_b, dv_b)


def stack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one seq-major buffer, (2, B, H, L, D), so one transfer moves both."""
    b, h, s, d = k.shape
    kv = torch.empty(2, b, s, h, d, dtype=k.dtype, device=k.device)
    kv[0].copy_(k.transpose(1, 2))
    kv[1].copy_(v.transpose(1, 2))
    return kv.transpose(2, 3)


def empty_seq_major(shape, *, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised (..., B, H, S, D) buffer, seq-major, fp32 unless told."""
    *lead, b, h, s, d = shape
    return torch.empty(*lead, b, s, h, d, dtype=dtype, device=like.device).transpose(-3, -2)
