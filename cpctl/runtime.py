"""The runtime a training script imports: process group, mesh, model and data preparation, CP.

    rt = cpctl.init()
    model = rt.prepare_model(model)
    loader = rt.prepare_dataloader(dataset, batch_size=1)
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        ...

Under `cpctl launch` the resolved profile arrives in CPCTL_RESOLVED_PROFILE; under plain
torchrun it is resolved here from the environment; under plain `python` the world is one
process and every parallel size is 1, so the same script runs unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import itertools
import logging
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cpctl import documents as packing
from cpctl import huggingface
from cpctl import config
from cpctl.attention import ChunkLayout, context_parallel_attention
from cpctl.attention import sharding
from cpctl.attention.dispatch import RouteSDPA
from cpctl.envinfo import require_torch
from cpctl.errors import CpctlError
from cpctl.mesh import build_mesh
from cpctl.parallelize import apply_activation_checkpointing, apply_fsdp, apply_tensor_parallel, find_blocks

@dataclass
class Runtime:
    """One process's view of the parallel job. Build it with `cpctl.init()`."""

    config: config.Profile
    mesh: DeviceMesh
    device: torch.device
    axes: dict[str, DeviceMesh]  # every axis by name, flattened ones included
    _cp_active: bool = False  # inside maybe_context_parallel
    _seq_lengths: dict[int, int] = field(default_factory=dict)  # this step's sharded lengths: full -> local
    # Set by each maybe_context_parallel, kept after it (rt.unshard of its results needs them):
    _step_layout: ChunkLayout | None = None  # a cost-balanced layout for packed documents
    _documents: list[packing.Starts] | None = None  # document starts per row, when packed
    cp_balance: float | None = None  # slowest CP rank's attention work / mean, this step (packed documents)
    _balance_logged: bool = False

    # ------------------------------------------------------------------ coordinates

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_size(self) -> int:
        return self.axes["cp"].size()

    @property
    def cp_rank(self) -> int:
        return self.axes["cp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.axes["dp"].size()

    @property
    def dp_rank(self) -> int:
        return self.axes["dp"].get_local_rank()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.axes["cp"].get_group()

    @property
    def cp_active(self) -> bool:
        """Inside maybe_context_parallel, with cp_size > 1."""
        return self._cp_active

    @property
    def layout(self) -> ChunkLayout:
        """This step's layout: head-tail (or plain) chunks, or a cost-balanced one for packed documents."""
        if self._step_layout is not None:
            return self._step_layout
        return ChunkLayout(cp_size=self.cp_size, cp_rank=self.cp_rank,
                           load_balance=self.config.parallelism.cp_load_balance)

    # ------------------------------------------------------------------ model and data

    def prepare_model(self, model: nn.Module, *, tp_plan: dict | None = None,
                      blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move to the device, apply TP (tp_size > 1), activation checkpointing and FSDP2.

        `blocks` are the modules to shard one by one (default: the children of the model's
        largest ModuleList, e.g. `model.layers`).
        """
        checkpointing = self.config.fsdp.activation_checkpointing
        if self.cp_size > 1 and huggingface.is_huggingface_model(model):
            # Its own gradient checkpointing would recompute outside CP's routing: ours instead.
            checkpointing = huggingface.prepare(model, self) or checkpointing
        before = {id(p): p for p in model.parameters()}
        model = model.to(self.device)
        if self.config.parallelism.tp_size > 1:
            apply_tensor_parallel(model, tp_mesh=self.axes["tp"], tp_plan=tp_plan)
        found = list(blocks) if blocks is not None else find_blocks(model)
        if checkpointing:
            apply_activation_checkpointing(found, model, recompute_context=self._recompute_context)
            found = find_blocks(model) if blocks is None else found
        if self.config.fsdp.version == 2:
            apply_fsdp(model, mesh=self.axes["fsdp"], fsdp=self.config.fsdp, blocks=found)
        elif self.axes["dp_cp"].size() > 1:
            # Without a gradient reduction the ranks would drift apart, and token_mean's scaling
            # (which expects the average over dp x cp ranks) would be wrong.
            raise CpctlError(
                "fsdp.version: 1 with several data-parallel ranks; cpctl's prepare_model applies FSDP2 only: "
                "set fsdp.version: 2 (or wrap the model in DDP/FSDP yourself and skip prepare_model)"
            )
        _forget_replaced_parameters(before, model)
        return model

    def _recompute_context(self) -> contextlib.AbstractContextManager:
        """Called in a checkpointed block's forward: route its recompute as the forward was routed."""
        return self._routing(self._documents) if self._cp_active else contextlib.nullcontext()

    @contextlib.contextmanager
    def _routing(self, documents: list[packing.Starts] | None) -> Iterator[None]:
        """Attention computed across the CP group: SDPA calls, and Hugging Face layers (which ask cp_active)."""
        was = self._cp_active, self._documents
        self._cp_active, self._documents = True, documents
        try:
            with RouteSDPA(self.step_attention, cp_size=self.cp_size):
                yield
        finally:
            self._cp_active, self._documents = was

    def prepare_dataloader(self, dataset, *, batch_size: int = 1, shuffle: bool = True, collate_fn=None,
                           seed: int = 0, **loader_kwargs) -> torch.utils.data.DataLoader:
        """A DataLoader whose batches differ across dp ranks and repeat across cp/tp ranks."""
        from torch.utils.data import DistributedSampler, IterableDataset

        if isinstance(dataset, IterableDataset):
            raise CpctlError("prepare_dataloader needs a map-style dataset (with __len__ and __getitem__) to split "
                             "it over dp ranks; for an IterableDataset, shard it by rt.dp_rank / rt.dp_size yourself")
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                     shuffle=shuffle, seed=seed, drop_last=True)
        return EpochDataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, **loader_kwargs)

    # ------------------------------------------------------------------ context parallelism

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's (load-balanced) shard of a full-length tensor, as a new tensor
        (with cp_size 1: the tensor itself, which is its whole shard)."""
        if self.cp_size == 1:
            return tensor
        return sharding.shard(tensor, seq_dim=seq_dim, layout=self.layout)

    def unshard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Gather a sequence-sharded tensor back to full length, in original token order."""
        if self.cp_size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.cp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.cp_group)
        return sharding.unshard(pieces, seq_dim=seq_dim, layout=self.layout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
                  chunk: int | None = None, documents: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """CP attention on already-sharded (batch, heads, local_seq, head_dim) tensors.

        `window`: each query sees the `window` keys ending at itself (and as many after it when
        not causal); `chunk`: only keys of its own `chunk`-token chunk (Llama 4); `documents`:
        per batch row, the start of every packed document; queries see only their own.
        """
        if self.cp_size == 1 and window is None and chunk is None and documents is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return context_parallel_attention(
            q, k, v, group=self.cp_group, layout=self.layout, strategy=self.config.parallelism.cp_comm_strategy,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window, chunk=chunk, documents=documents)

    def step_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        """`attention` with this step's packed documents: what routed calls inside the context get."""
        return self.attention(q, k, v, documents=self._documents, **options)

    def require_sharded(self, tensor: torch.Tensor | None, *, name: str, seq_dim: int) -> None:
        """Inside maybe_context_parallel: `tensor` must have this step's local length along `seq_dim`."""
        if tensor is None or not self._cp_active or tensor.dim() <= seq_dim % max(tensor.dim(), 1):
            return
        length = tensor.shape[seq_dim]
        if length in self._seq_lengths.values():
            return
        if length in self._seq_lengths:
            raise CpctlError(
                f"{name} has the full sequence length {length} inside maybe_context_parallel; add it to buffers "
                "(with its sequence dim) so it is sharded like the other inputs"
            )
        raise CpctlError(f"{name} has sequence length {length}, but this step's sharded buffers have "
                         f"{sorted(self._seq_lengths.values())} tokens per rank")

    def adopt_position_ids(self, position_ids: torch.Tensor) -> None:
        """Sharded position ids that a model is called with: where they restart, documents are packed.

        With `maybe_context_parallel(documents=...)` they must agree with it; without, their
        documents are computed exactly on this step's (head-tail) layout.
        """
        rows = packing.documents_or_none(packing.starts_per_row(self.unshard(position_ids, seq_dim=-1)))
        if self._documents is None:
            self._documents = rows
        elif (rows or []) * (len(self._documents) if rows and len(rows) == 1 else 1) != self._documents:
            raise CpctlError("the model's position_ids and maybe_context_parallel(documents=...) place documents "
                             "differently; pass the same position ids to both")

    def shift_sharded(self, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of a sharded (batch, local_seq) tensor, as `cpctl.shift_labels` gives
        them on the full sequence: each chunk's last token takes the next chunk's first."""
        if self.cp_size == 1:
            from cpctl.data import shift_labels

            return shift_labels(labels, ignore_index=ignore_index)
        layout, chunk_len = self.layout, labels.shape[1] // len(self.layout.local_chunks)
        firsts = labels[:, ::chunk_len].contiguous()  # (batch, local chunks)
        gathered = [torch.empty_like(firsts) for _ in range(self.cp_size)]
        dist.all_gather(gathered, firsts, group=self.cp_group)
        first_of = {chunk: gathered[rank][:, pos] for rank in range(self.cp_size)
                    for pos, chunk in enumerate(layout.chunks_of(rank))}
        shifted = torch.full_like(labels, ignore_index)
        for pos, chunk in enumerate(layout.local_chunks):
            start, stop = pos * chunk_len, (pos + 1) * chunk_len
            shifted[:, start:stop - 1] = labels[:, start + 1:stop]
            if chunk + 1 < layout.num_chunks:
                shifted[:, stop - 1] = first_of[chunk + 1]
        return shifted

    def reduce_over_dp_cp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the ranks whose gradients FSDP averages (dp x cp)."""
        dist.all_reduce(tensor, group=self.axes["dp_cp"].get_group())
        return tensor

    @contextlib.contextmanager
    def maybe_context_parallel(self, *, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                               no_restore_buffers: Iterable[torch.Tensor] = (),
                               documents: torch.Tensor | None = None) -> Iterator[None]:
        """Shard `buffers` in place along their sequence dims and compute every SDPA call
        across the CP group; on exit restore the buffers not in `no_restore_buffers`.
        Enter it anew every step. With cp_size 1 it does nothing.

        `documents`: full-length position ids (batch, seq) that restart at each packed
        document (as transformers' DataCollatorWithFlattening makes them): attention stays
        inside documents, and the chunks are assigned to ranks by cost.
        """
        buffers, no_restore = list(buffers), list(no_restore_buffers)
        _check_buffers(buffers, list(buffer_seq_dims), no_restore)
        if documents is not None and not isinstance(documents, torch.Tensor):
            raise CpctlError("maybe_context_parallel: documents must be a tensor of position ids, "
                             "e.g. cpctl.position_ids_for_documents(lengths)")
        if self.cp_size == 1:
            yield
            return
        self._check_same_inputs(buffers if documents is None else [*buffers, documents])
        self._place(documents, seq_len=buffers[0].shape[buffer_seq_dims[0]] if buffers else 0)
        originals = []
        with torch.no_grad():
            # Every shard first (each checks its length), so a bad buffer leaves none half-done.
            shards = [sharding.shard(b, seq_dim=d, layout=self.layout) for b, d in zip(buffers, buffer_seq_dims)]
            self._seq_lengths = {b.shape[d]: s.shape[d] for b, s, d in zip(buffers, shards, buffer_seq_dims)}
            for buffer, local in zip(buffers, shards):
                keep = not any(buffer is t for t in no_restore)
                originals.append(_alias(buffer) if keep else None)
                buffer.set_(local)
        try:
            with self._routing(self._documents):
                yield
        finally:
            self._seq_lengths = {}
            with torch.no_grad():
                for buffer, original in zip(buffers, originals):
                    if original is not None:
                        buffer.set_(original)

    def _place(self, documents: torch.Tensor | None, *, seq_len: int) -> None:
        """This step's layout and documents: head-tail, or by cost when documents are packed."""
        self._step_layout, self._documents, self.cp_balance = None, None, None
        if documents is None:
            return
        if documents.shape[-1] != seq_len:
            raise CpctlError(f"maybe_context_parallel: documents has {documents.shape[-1]} positions but the "
                             f"first buffer {seq_len} tokens; pass the full-length position ids")
        self._documents = packing.documents_or_none(packing.starts_per_row(documents))
        if self._documents is None or not self.config.parallelism.cp_load_balance:
            return
        self.layout.check_length(seq_len)
        placed = packing.place(self._documents, seq_len=seq_len, cp_size=self.cp_size, cp_rank=self.cp_rank)
        self._step_layout, self.cp_balance = placed.layout, placed.balance
        if self.is_main:
            # once at INFO (the run's log says how its documents are spread), then per step at DEBUG
            level = logging.DEBUG if self._balance_logged else logging.INFO
            self._balance_logged = True
            _log.log(level, "packed documents: %d chunks per rank assigned by cost; attention work max/mean %.3f "
                     "(head-tail chunks: %.3f)", len(placed.layout.local_chunks), placed.balance,
                     placed.head_tail_balance)

    def _check_same_inputs(self, buffers: list[torch.Tensor]) -> None:
        """Every rank of a CP group must hold the same full buffers: compare cheap fingerprints."""
        mine = _fingerprints(buffers).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.cp_size)]
        dist.all_gather(gathered, mine, group=self.cp_group)
        for rank, theirs in enumerate(gathered):
            if not torch.equal(theirs, gathered[0]):
                row = int((theirs != gathered[0]).any(dim=1).nonzero()[0])
                what = "how many buffers" if row == 0 else f"buffer {row - 1} (shape or contents)"
                raise CpctlError(
                    f"maybe_context_parallel: CP ranks {self.cp_rank_to_global(0)} and {self.cp_rank_to_global(rank)} "
                    f"got different inputs ({what} differs); every rank of a CP group must get the same batch: "
                    "load data with rt.prepare_dataloader, or seed every rank alike"
                )

    def raise_together(self, problem: str | None) -> None:
        """Raise on every CP rank if any found `problem` in its own shard.

        An error on some ranks only would leave the others in the next collective, waiting for
        peers that are gone (or, worse, matched with the wrong call).
        """
        flag = torch.tensor([0 if problem is None else 1], device=self.device)
        dist.all_reduce(flag, group=self.cp_group)
        if not int(flag.item()):
            return
        problems = [None] * self.cp_size
        dist.all_gather_object(problems, problem, group=self.cp_group)
        rank, first = next((r, p) for r, p in enumerate(problems) if p is not None)
        raise CpctlError(first if problem is not None else f"CP rank {self.cp_rank_to_global(rank)}: {first}")

    def cp_rank_to_global(self, cp_rank: int) -> int:
        return dist.get_process_group_ranks(self.cp_group)[cp_rank]

    # ------------------------------------------------------------------ losses

    def token_mean(self, loss_sum: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """The token-mean loss of the whole dp x cp batch, from this rank's summed loss.

        Its value is the global mean on every rank. Its gradient is this rank's share scaled
        so that, after FSDP averages gradients over the dp_replicate x dp_shard x cp ranks,
        every parameter holds the single-process gradient of the global token mean.
        """
        self.require_sharded(labels, name="token_mean's labels", seq_dim=1 if labels.dim() > 1 else 0)
        group = self.axes["dp_cp"].get_group()
        stats = torch.stack([loss_sum.detach().float(), (labels != ignore_index).sum().float()])
        dist.all_reduce(stats, group=group)
        total_loss, total_tokens = stats[0], stats[1].clamp(min=1)
        averaging = self.axes["dp_cp"].size()  # FSDP's gradient reduction divides by this
        share = loss_sum * (averaging / total_tokens)
        return share + (total_loss / total_tokens - share).detach()

    def document_mean(self, token_losses: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, *,
                      ignore_index: int = -100) -> torch.Tensor:
        """The mean over every packed document of the dp x cp batch of its own token-mean loss.

        `token_losses` (cross-entropy with reduction="none"), `labels` and `position_ids` are
        this rank's shards, (batch, local_seq), or full rows with cp_size 1. A document's
        tokens may sit on several ranks: its sum and count are reduced over the CP group
        first. Value and gradient as `token_mean`'s: the global mean on every rank, and the
        single-process gradient after FSDP's averaging.
        """
        for name, tensor in (("labels", labels), ("position_ids", position_ids)):
            self.require_sharded(tensor, name=f"document_mean's {name}", seq_dim=1)
        full_positions = self.unshard(position_ids, seq_dim=1)
        starts = packing.starts_per_row(full_positions)
        # each local token's document, numbered across the rows of this rank's batch
        offsets = torch.tensor([0, *itertools.accumulate(len(row) for row in starts)][:-1], device=labels.device)
        global_pos = self.shard(torch.arange(full_positions.shape[1], device=labels.device).expand_as(full_positions),
                                seq_dim=1)
        doc = torch.stack([torch.searchsorted(torch.tensor(row, device=labels.device), global_pos[b], right=True) - 1
                           for b, row in enumerate(starts)]) + offsets[:, None]
        kept = labels != ignore_index
        num_docs = sum(len(row) for row in starts)
        sums = torch.zeros(num_docs, dtype=torch.float32, device=labels.device)
        counts = torch.zeros(num_docs, dtype=torch.float32, device=labels.device)
        sums.index_add_(0, doc[kept], token_losses[kept].detach().float())
        counts.index_add_(0, doc[kept], torch.ones_like(sums[doc[kept]]))
        totals = torch.cat([sums, counts])
        dist.all_reduce(totals, group=self.cp_group)  # the same documents on every CP rank
        sums, counts = totals[:num_docs], totals[num_docs:]
        with_tokens = counts > 0
        stats = torch.stack([(sums[with_tokens] / counts[with_tokens]).sum(), with_tokens.sum().float()])
        dist.all_reduce(stats, group=self.axes["dp"].get_group())  # other dp ranks: other documents
        total_means, total_docs = stats[0], stats[1].clamp(min=1)
        weights = (1.0 / counts.clamp(min=1))[doc] * kept
        averaging = self.axes["dp_cp"].size()
        share = (token_losses * weights).sum() * (averaging / total_docs)
        return share + (total_means / total_docs - share).detach()


class EpochDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose every pass is a new epoch: its DistributedSampler reshuffles."""

    _epoch = 0

    def __iter__(self):
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return super().__iter__()


_FINGERPRINT_ROWS, _FINGERPRINT_SAMPLE = 16, 65536
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprints(buffers: list[torch.Tensor]) -> torch.Tensor:
    """(rows, 8) int64: a header row with the count, then per buffer its shape and a hash of
    up to 65536 evenly spaced elements (their bits, so floats compare exactly)."""
    table = torch.zeros(_FINGERPRINT_ROWS + 1, 8, dtype=torch.int64)
    table[0, 0] = len(buffers)
    for row, buffer in enumerate(buffers[:_FINGERPRINT_ROWS], start=1):
        shape = list(buffer.shape)[-6:]
        table[row, 0] = buffer.dim()
        table[row, 1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        flat = buffer.detach().reshape(-1)
        flat = flat[:: max(1, flat.numel() // _FINGERPRINT_SAMPLE)]
        if flat.is_floating_point() or flat.is_complex():
            flat = flat.contiguous().view(_SAME_WIDTH_INT[flat.element_size()])
        values = flat.to(torch.int64).cpu()
        weights = torch.arange(values.numel(), dtype=torch.int64) % 1_000_003 + 1
        table[row, 7] = int((values * weights).sum())
    return table


def _forget_replaced_parameters(before: dict[int, torch.Tensor], model: nn.Module) -> None:
    """Remember the parameters prepare_model replaced, so an optimizer that still holds them
    (created before prepare_model: it would train nothing) fails at its first step."""
    kept = {id(p) for p in model.parameters()}
    for key, param in before.items():
        if key not in kept:
            _REPLACED[key] = param
    global _OPTIMIZER_HOOK
    if _REPLACED and _OPTIMIZER_HOOK is None:
        _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_refuse_replaced_parameters)


_REPLACED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_OPTIMIZER_HOOK = None


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if _REPLACED.get(id(param)) is param:
                raise CpctlError(
                    f"{type(optimizer).__name__} holds the model's parameters from before rt.prepare_model, which "
                    "replaced them (FSDP2 shards them): it would train nothing. Create the optimizer after "
                    "rt.prepare_model, from the model it returns"
                )


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A second handle on `tensor`'s current storage and shape, to put back after set_()."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _check_buffers(buffers: list, seq_dims: list, no_restore: list) -> None:
    if len(buffers) != len(seq_dims):
        raise CpctlError(f"maybe_context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims; "
                         "give one sequence dim per buffer")
    for item in [*buffers, *no_restore]:
        if not isinstance(item, torch.Tensor):
            raise CpctlError(f"maybe_context_parallel: buffers must be tensors, got {type(item).__name__}")
    if len({id(b) for b in buffers}) != len(buffers):
        raise CpctlError("maybe_context_parallel: a tensor appears twice in buffers; pass each buffer once")
    for t in no_restore:
        if not any(t is b for b in buffers):
            raise CpctlError("maybe_context_parallel: no_restore_buffers must be a subset of buffers; "
                             f"a tensor of shape {tuple(t.shape)} is not among the buffers")
    for buffer, seq_dim in zip(buffers, seq_dims):
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise CpctlError(f"maybe_context_parallel: buffer_seq_dims must be integers, got {seq_dim!r}")
        if buffer.requires_grad:
            raise CpctlError(
                f"maybe_context_parallel: a buffer of shape {tuple(buffer.shape)} requires grad and cannot be "
                "sharded in place; pass inputs (ids, labels, positions) and shard activations with rt.shard()"
            )
        if not -buffer.dim() <= seq_dim < buffer.dim():
            raise CpctlError(f"maybe_context_parallel: buffer_seq_dims has {seq_dim} for a {buffer.dim()}-D buffer")


# ---------------------------------------------------------------------- init

_log = logging.getLogger("cpctl")
_RUNTIME: Runtime | None = None
_INIT_OVERRIDES: dict[str, Any] = {}


def active_runtime() -> Runtime | None:
    """The runtime while inside its maybe_context_parallel with cp_size > 1, else None."""
    return _RUNTIME if _RUNTIME is not None and _RUNTIME.cp_active else None


def init(**overrides: Any) -> Runtime:
    """Start this process's runtime once; later calls return the same one.

    `overrides` are profile keys by name (`cp_size=2`, `cp_comm_strategy="alltoall"`) and
    win over everything else, as launch flags do.
    """
    global _RUNTIME, _INIT_OVERRIDES
    if _RUNTIME is not None:
        if overrides and overrides != _INIT_OVERRIDES:
            raise CpctlError(f"cpctl.init() already ran with {_INIT_OVERRIDES or 'no overrides'}; "
                             f"it cannot change to {overrides} in the same process")
        return _RUNTIME
    require_torch(torch.__version__)
    profile = _profile_for_this_process(overrides)
    device = _device_for(profile)
    if not dist.is_initialized():
        _init_process_group(device)
        _note_uncaught_exceptions()
        atexit.register(_shutdown)
    mesh, axes = build_mesh(profile.parallelism, device_type=device.type)
    _RUNTIME, _INIT_OVERRIDES = Runtime(config=profile, mesh=mesh, device=device, axes=axes), dict(overrides)
    return _RUNTIME


def _profile_for_this_process(overrides: dict[str, Any]) -> config.Profile:
    return config.for_worker(overrides, environ=os.environ, cuda_devices=torch.cuda.device_count()).profile


def _device_for(profile: config.Profile) -> torch.device:
    if profile.launch.device == "cuda":
        if not torch.cuda.is_available():
            raise CpctlError("the profile says device cuda but torch sees no GPU; use --device cpu")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_process_group(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # a world of one, without a launcher's rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


_FAILED = False  # an exception ended the script: peers may never reach the exit barrier
_EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=30)


def _note_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def hook(*exc_info):
        global _FAILED
        _FAILED = True
        previous(*exc_info)

    sys.excepthook = hook


def _shutdown() -> None:
    """Tear the process groups down while Python is fully alive.

    gloo's worker threads may still hold the tensors of finished collectives; if they free them
    during interpreter finalization, the thread is killed mid-destructor and the process aborts
    ("terminate called without an active exception", exit 134). A barrier first lets every
    rank's threads go idle and no rank close connections a peer still uses; collecting garbage
    after destroy_process_group frees the groups FSDP's and the mesh's reference cycles hold.
    """
    global _RUNTIME
    _RUNTIME = None
    if not dist.is_initialized():
        return
    if not _FAILED and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        with contextlib.suppress(RuntimeError):  # a peer that never arrives must not hold this rank
            dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
    dist.destroy_process_group()
    gc.collect()
