"""Running a plan of blocks: forward with exact log-sum-exp merging, backward into gradient buffers.

All (B, H, S, D) tensors here are seq-major views (see `kernels.seq_major`), so a block's
rows are a dense slice that the kernels read in place.
"""

from __future__ import annotations

import torch

from cpctl.attention.kernels import (
    expand_kv,
    fold_kv_grad,
    accumulation_dtype,
    block_backward,
    block_forward,
    explicit_backward,
    explicit_forward,
    window_backward,
    window_forward,
    windowed_flash_works,
)
from cpctl.attention.masks import Visibility, tiles
from cpctl.attention.plan import Block
from cpctl.attention.spec import AttentionSpec


class ForwardAccumulator:
    """Partial attention results of one rank's queries, merged exactly with their LSE.

    Merging in fp32: new_lse = logaddexp(lse, lse_b); out = out * e^(lse - new) + out_b * e^(lse_b - new)
    (`merge`). `logaddexp` is stable where the naive log(1 + exp(.)) overflows. A row's first
    block is copied, not merged. Rows no block reaches (queries that see no key: left
    padding) come out as SDPA gives a fully masked row: output 0, LSE -inf.
    """

    def __init__(self, q: torch.Tensor, *, chunk_len: int, num_chunks: int):
        dtype = accumulation_dtype(q.dtype)
        self.out = empty_seq_major(q.shape, like=q)
        self.lse = torch.empty(q.shape[:3], dtype=dtype, device=q.device)
        self.chunk_len = chunk_len
        self.written = [False] * num_chunks

    def add(self, block: Block, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        self._add(block.q_start, block.q_stop, out_b, lse_b)

    def _add(self, first: int, stop: int, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        c = self.chunk_len
        rows = slice(first * c, stop * c)
        fresh = [not self.written[chunk] for chunk in range(first, stop)]
        if all(fresh):
            self.out[:, :, rows].copy_(out_b)
            self.lse[:, :, rows].copy_(lse_b)
        elif not any(fresh):
            merge(self.out[:, :, rows], self.lse[:, :, rows], out_b, lse_b)
        else:  # padding can leave a chunk unseen by earlier blocks: chunk by chunk then
            for offset, chunk in enumerate(range(first, stop)):
                self._add(chunk, chunk + 1, out_b[:, :, offset * c:(offset + 1) * c], lse_b[:, :, offset * c:(offset + 1) * c])
            return
        for chunk in range(first, stop):
            self.written[chunk] = True

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.chunk_len
        for chunk, written in enumerate(self.written):
            if not written:  # its queries see no key
                self.out[:, :, chunk * c:(chunk + 1) * c].zero_()
                self.lse[:, :, chunk * c:(chunk + 1) * c].fill_(float("-inf"))
        return self.out.to(dtype), self.lse


def forward_blocks(acc: ForwardAccumulator, blocks: list[Block], q, k, v, *, spec: AttentionSpec) -> None:
    c = acc.chunk_len
    for blk in blocks:
        rows, kv_rows = slice(blk.q_start * c, blk.q_stop * c), slice(blk.kv_start * c, blk.kv_stop * c)
        if blk.partial:
            out_b, lse_b = _partial_forward(blk, q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows], spec=spec)
        else:
            out_b, lse_b = block_forward(q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows],
                                         causal=blk.causal, scale=spec.scale)
        acc.add(blk, out_b, lse_b)


def _block_tiles(blk: Block, spec: AttentionSpec):
    c = spec.chunk_len
    return tiles(spec.mask, q_start=blk.q_chunk * c, k_start=blk.kv_chunk * c, q_len=c, k_len=c, seq_len=spec.seq_len)


def _partial_forward(blk: Block, q, k, v, *, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair cut by the mask: its tiles merged into (out, lse) as if one kernel call.

    Rows that see none of the pair's keys keep lse = -inf and out = 0, which merge as nothing.
    """
    dtype = accumulation_dtype(q.dtype)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=dtype, device=q.device)
    window = _window_call(blk, spec, q)
    if window is not None:
        rows, keys, left, right = window
        groups = q.shape[1] // k.shape[1]
        out_w, lse_w = window_forward(q[:, :, rows], expand_kv(k[:, :, keys], groups), expand_kv(v[:, :, keys], groups),
                                      left=left, right=right, scale=spec.scale)
        out[:, :, rows], lse[:, :, rows] = out_w, lse_w
        return out, lse
    for tile in _block_tiles(blk, spec):
        qt, kt, vt = q[:, :, tile.q0:tile.q1], k[:, :, tile.k0:tile.k1], v[:, :, tile.k0:tile.k1]
        if tile.kind is Visibility.PARTIAL:
            allowed = _tile_mask(blk, tile, spec, q.device)
            out_t, lse_t = explicit_forward(qt, kt, vt, allowed=allowed, scale=spec.scale)
        else:
            out_t, lse_t = block_forward(qt, kt, vt, causal=tile.kind is Visibility.DIAGONAL, scale=spec.scale)
        merge(out[:, :, tile.q0:tile.q1], lse[:, :, tile.q0:tile.q1], out_t, lse_t)
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a partial result (out_b, lse_b) into (out, lse) in place, exactly.

    A row that has seen no key yet on either side has lse -inf on both; exp(-inf - -inf)
    would be nan, so such rows stay empty (factor 0) instead.
    """
    lse_b = lse_b.to(lse.dtype)
    new_lse = torch.logaddexp(lse, lse_b)
    keep = torch.exp(lse - new_lse).nan_to_num_(0.0)
    take = torch.exp(lse_b - new_lse).nan_to_num_(0.0)
    out.mul_(keep.unsqueeze(-1)).add_(out_b.to(out.dtype) * take.unsqueeze(-1))
    lse.copy_(new_lse)


def _window_call(blk: Block, spec: AttentionSpec, q: torch.Tensor):
    """(rows, keys, left, right) when the pair is one windowed flash call on CUDA, else None.

    A causal sliding window inside the pair's bounding box is a band the kernel's window
    (bottom-right aligned) expresses exactly, when both of its sizes come out non-negative.
    """
    mask = spec.mask
    if not (q.is_cuda and mask.causal and mask.window is not None and mask.chunk is None and mask.documents is None
            and mask.hidden is None):
        return None
    c = spec.chunk_len
    q0, k0 = blk.q_chunk * c, blk.kv_chunk * c
    a, b, ka, kb = mask.bounding_box(q0, q0 + c, k0, k0 + c, seq_len=spec.seq_len)
    shift, offset = (kb - ka) - (b - a), a - ka  # kernel alignment; query-to-key position offset
    right, left = offset - shift, shift - offset + mask.window - 1
    if left < 0 or right < 0 or not windowed_flash_works(q.dtype, q.shape[-1], q.device.index):
        return None
    return slice(a - q0, b - q0), slice(ka - k0, kb - k0), left, right


def _tile_mask(blk: Block, tile, spec: AttentionSpec, device: torch.device) -> torch.Tensor:
    c = spec.chunk_len
    q_pos = torch.arange(blk.q_chunk * c + tile.q0, blk.q_chunk * c + tile.q1, device=device)
    k_pos = torch.arange(blk.kv_chunk * c + tile.k0, blk.kv_chunk * c + tile.k1, device=device)
    return spec.mask.dense(q_pos, k_pos, seq_len=spec.seq_len)


def _partial_backward(blk: Block, dout, q, k, v, out, lse, *, spec: AttentionSpec):
    """Gradients of a partial chunk pair, tile by tile, given the row's merged out and lse."""
    dtype = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    window = _window_call(blk, spec, q)
    if window is not None:
        rows, keys, left, right = window
        groups = q.shape[1] // k.shape[1]
        grads = window_backward(dout[:, :, rows].contiguous(), q[:, :, rows], expand_kv(k[:, :, keys], groups),
                                expand_kv(v[:, :, keys], groups), out[:, :, rows], lse[:, :, rows].float(),
                                left=left, right=right, scale=spec.scale)
        dq[:, :, rows] = grads[0]
        dk[:, :, keys] = fold_kv_grad(grads[1], groups)
        dv[:, :, keys] = fold_kv_grad(grads[2], groups)
        return dq, dk, dv
    for tile in _block_tiles(blk, spec):
        rows, keys = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
        args = (dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                lse[:, :, rows].contiguous())
        if tile.kind is Visibility.PARTIAL:
            grads = explicit_backward(*args, allowed=_tile_mask(blk, tile, spec, q.device), scale=spec.scale)
        else:
            grads = block_backward(*args, causal=tile.kind is Visibility.DIAGONAL, scale=spec.scale)
        dq[:, :, rows] += grads[0]
        dk[:, :, keys] += grads[1]
        dv[:, :, keys] += grads[2]
    return dq, dk, dv


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
    blocks: list[Block], *, dout, q, k, v, out, lse, dq: ChunkSink, dkv: ChunkSink, chunk_len: int,
    spec: AttentionSpec,
) -> None:
    """Each block's gradients: dq into the local queries' sink, dk/dv into the K/V buffer's sink."""
    c = chunk_len
    for blk in blocks:
        rows = slice(blk.q_start * c, blk.q_stop * c)
        kv_rows = slice(blk.kv_start * c, blk.kv_stop * c)
        args = (dout[:, :, rows], q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows], out[:, :, rows],
                lse[:, :, rows].contiguous())
        if blk.partial:
            dq_b, dk_b, dv_b = _partial_backward(blk, *args, spec=spec)
        else:
            dq_b, dk_b, dv_b = block_backward(*args, causal=blk.causal, scale=spec.scale)
        dq.add(blk.q_start, dq_b)
        dkv.add(blk.kv_start, dk_b, dv_b)


def stack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one seq-major buffer, (2, B, H, L, D), so one transfer moves both."""
    b, h, s, d = k.shape
    kv = torch.empty(2, b, s, h, d, dtype=k.dtype, device=k.device)
    kv[0].copy_(k.transpose(1, 2))
    kv[1].copy_(v.transpose(1, 2))
    return kv.transpose(2, 3)


def empty_seq_major(shape, *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised (..., B, H, S, D) buffer, seq-major, in `like`'s accumulation dtype unless told."""
    dtype = dtype or accumulation_dtype(like.dtype)
    *lead, b, h, s, d = shape
    return torch.empty(*lead, b, s, h, d, dtype=dtype, device=like.device).transpose(-3, -2)
