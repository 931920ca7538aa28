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

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpctl import config
from cpctl.attention import ChunkLayout, context_parallel_attention
from cpctl.attention.dispatch import RouteSDPA
from cpctl.attention.ulysses import ulysses_attention
from cpctl.errors import CpctlError
from cpctl.integrations import huggingface
from cpctl.runtime import documents as packing
from cpctl.runtime import guards, loading, losses, padding, process
from cpctl.runtime.checkpoint_levels import BlockLevels
from cpctl.runtime.loader import EpochDataLoader, ResumableSampler
from cpctl.runtime.mesh import build_mesh
from cpctl.runtime.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tensor_parallel,
    find_blocks,
)
from cpctl.runtime.pinned import HostArena, offload_saved_activations
from cpctl.runtime.selective import AttentionMemo
from cpctl.runtime.step import HiddenKeys, RowMasks, SequenceSplit, Step
from cpctl.runtime.tiling import apply_tiled_mlp, apply_tiled_norms
from cpctl.versions import require_torch


@dataclass
class Runtime:
    """One process's view of the parallel job. Build it with `cpctl.init()`."""

    config: config.Profile
    mesh: DeviceMesh
    device: torch.device
    axes: dict[str, DeviceMesh]  # every axis by name, flattened ones included
    # The step whose body runs (maybe_context_parallel, a checkpointed block's recompute); None outside.
    _step: Step | None = None
    last_step: Step | None = None  # the latest step entered: after its context, its results are gathered with it
    _plain: Step | None = None  # what holds outside any step (the plain layout), made once
    _balance_logged: bool = False
    _memo: AttentionMemo | None = None  # the checkpointed block whose attention outputs are kept (selective level)
    _host_arena: HostArena | None = None  # host memory of the offloaded activations (memory.offload_activations)
    _levels: BlockLevels | None = None  # which checkpointed blocks are selective (memory.checkpoint_level)
    caller_counts_tokens: bool = False  # inside caller_counts_loss_tokens(): a model may take num_items_in_batch
    attention_calls: int = 0  # calls of the CP engine so far (a model's attention can be seen to go through it)

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
    def sp_size(self) -> int:
        """Ulysses ranks: they split attention heads inside attention, and the cp rank's tokens outside it."""
        return self.axes["sp"].size()

    @property
    def sp_rank(self) -> int:
        return self.axes["sp"].get_local_rank()

    @property
    def seq_size(self) -> int:
        """How many ranks split one sequence: cp_size x sp_size."""
        return self.axes["cp_sp"].size()

    @property
    def seq_group(self) -> dist.ProcessGroup:
        """The ranks that split one sequence (cp-major, sp inner): shards, unshards and their checks go over it."""
        return self.axes["cp_sp"].get_group()

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
        """Inside maybe_context_parallel's routing (at every cp size, 1 included)."""
        return self._step is not None

    @property
    def split(self) -> SequenceSplit:
        """Where this rank sits among the ranks that split one sequence."""
        return SequenceSplit(cp_size=self.cp_size, cp_rank=self.cp_rank, sp_size=self.sp_size, sp_rank=self.sp_rank,
                             load_balance=self.config.parallelism.cp_load_balance)

    def _current_step(self) -> Step:
        """The step whose body runs, else the plain layout that holds outside any step."""
        if self._step is not None:
            return self._step
        if self._plain is None:
            self._plain = Step.plain(self.split, group=self.seq_group)
        return self._plain

    @property
    def ring_layout(self) -> ChunkLayout:
        """The chunks each cp rank holds this step: head-tail (or plain), or cost-balanced for packed
        documents. At cp_size 1 one chunk, the whole sequence: there is no other rank to balance against."""
        return self._current_step().ring_layout

    @property
    def layout(self) -> ChunkLayout:
        """The tokens this rank holds this step: the ring's chunks, each cut over the sp ranks (sp > 1)."""
        return self._current_step().layout

    @property
    def cp_balance(self) -> float | None:
        """The latest step's slowest CP rank's attention work / mean (packed documents; else None)."""
        return None if self.last_step is None else self.last_step.balance

    @property
    def step_local_length(self) -> int | None:
        """The latest step's tokens per rank (padding included)."""
        return None if self.last_step is None else self.last_step.local_length

    # ------------------------------------------------------------------ model and data

    def prepare_model(self, model: nn.Module, *, tp_plan: dict | None = None,
                      blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move to the device, apply TP (tp_size > 1), activation checkpointing and FSDP2.

        `blocks` are the modules to shard one by one (default: the children of the model's
        largest ModuleList, e.g. `model.layers`).
        """
        before = {id(p): p for p in model.parameters()}
        checkpointing = self._adopt(model)
        if loading.has_meta_parameters(model):  # rt.from_pretrained's: given memory once sharded
            loading.move_buffers(model, self.device)
        else:
            model = model.to(self.device)
        if self.config.parallelism.tp_size > 1:
            apply_tensor_parallel(model, tp_mesh=self.axes["tp"], tp_plan=tp_plan)
        found = self._transform_blocks(model, list(blocks) if blocks is not None else None, checkpointing=checkpointing)
        if self.config.fsdp.version == 2:
            apply_fsdp(model, mesh=self.axes["fsdp"], fsdp=self.config.fsdp, blocks=found,
                       cpu_offload=self.config.memory.cpu_offload)
            guards.refuse_parameters_added_later(model)
        elif self.axes["dp_cp"].size() > 1:
            # Without a gradient reduction the ranks would drift apart, and token_mean's scaling
            # (which expects the average over dp x cp ranks) would be wrong.
            raise CpctlError(
                "fsdp.version: 1 with several data-parallel ranks; cpctl's prepare_model applies FSDP2 only: "
                "set fsdp.version: 2 (or wrap the model in DDP/FSDP yourself and skip prepare_model)"
            )
        self.finish_model(model)
        guards.forget_replaced_parameters(before, model)
        return model

    def from_pretrained(self, model_class: Any, path: str | os.PathLike, *, tp_plan: dict | None = None,
                        **kwargs: Any) -> nn.Module:
        """`model_class.from_pretrained(path, **kwargs)` prepared as prepare_model does, without a
        full copy of the weights on any rank: built on the meta device, sharded, then each rank
        reads its shards' slices of the local safetensors files (runtime/loading.py). Collective.

        `model_class` is a transformers class (`AutoModelForCausalLM`, `LlamaForCausalLM`);
        `kwargs` go to it as to from_pretrained (`attn_implementation`, `dtype`). Like
        from_pretrained it returns the model in eval mode: call `model.train()` to train."""
        model, tied = loading.build_on_meta(model_class, path, **kwargs)
        model = self.prepare_model(model, tp_plan=tp_plan)
        loading.load_weights(model, path, device=self.device, tied=tied)
        return model.eval()

    def ready_model(self, model: nn.Module) -> nn.Module:
        """What prepare_model does before FSDP, for a framework that applies FSDP itself
        (accelerate): cpctl's attention for a Hugging Face model, tiled MLPs, checkpointing."""
        self._transform_blocks(model, None, checkpointing=self._adopt(model))
        return model

    def finish_model(self, model: nn.Module) -> nn.Module:
        """What prepare_model does after FSDP: the offload of saved activations."""
        if self.config.memory.offload_activations:
            offload_saved_activations(model, arena=self.host_arena)
        return model

    @property
    def host_arena(self) -> HostArena | None:
        """Where offloaded activations wait for backward (with memory.offload_activations): its
        `peak_bytes` is the host memory they took, `cpctl plan`'s "pinned host memory"."""
        if self._host_arena is None and self.config.memory.offload_activations:
            self._host_arena = HostArena(self.device)
        return self._host_arena

    def _adopt(self, model: nn.Module) -> bool:
        """A Hugging Face model's attention through cpctl (at every cp size); whether it is to be checkpointed."""
        if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            # its compiled graph would keep the attention it was traced with, and FSDP2 would wrap the wrapper
            raise CpctlError("the model was compiled (torch.compile) before rt.prepare_model: prepare the model "
                             "itself, then compile what prepare_model returns (model = torch.compile(rt.prepare_model(model)))")
        guards.refuse_quantized(model)
        checkpointing = self.config.fsdp.activation_checkpointing
        inner = huggingface.huggingface_model_in(model)  # the model itself, or the one a PEFT model wraps
        if inner is not None:
            # Its own gradient checkpointing would recompute outside CP's routing: ours instead.
            checkpointing = huggingface.prepare(inner, self).had_checkpointing or checkpointing
        return checkpointing

    def _transform_blocks(self, model: nn.Module, blocks: list[nn.Module] | None, *, checkpointing: bool) -> list[nn.Module]:
        """Tiled MLPs and norms, and checkpointing per block; the blocks FSDP then shards (wrapped ones, if found here)."""
        found = blocks if blocks is not None else find_blocks(model)
        memory = self.config.memory
        if memory.tiled_mlp_tokens:  # before checkpointing wraps the blocks
            apply_tiled_mlp(found, tile_tokens=memory.tiled_mlp_tokens)
        if memory.tiled_norm_tokens:
            apply_tiled_norms(found, tile_tokens=memory.tiled_norm_tokens, model=model)
        if checkpointing:
            self._levels = BlockLevels(self.config, blocks=len(found), model=model, device=self.device)
            wrappers = apply_activation_checkpointing(found, model, contexts=self._checkpoint_contexts)
            if self._levels.choosing and wrappers:  # before its level is asked for: the step's shape
                wrappers[0].register_forward_pre_hook(self._observe_first_block, with_kwargs=True)
            found = find_blocks(model) if blocks is None else found
        return found

    def _observe_first_block(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        levels = self._levels
        if levels is not None:
            levels.observe(args[0] if args else kwargs.get("hidden_states"))

    @property
    def selective_blocks(self) -> int | None:
        """How many checkpointed blocks (the last ones) keep attention's tensors, as of the last
        step (memory.checkpoint_level); None without activation checkpointing."""
        return None if self._levels is None else self._levels.count

    def _checkpoint_contexts(self, index: int) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """Called at each call of checkpointed block `index`: the contexts around its forward and its recompute.

        The recompute is routed as the forward was; at the selective level (in the blocks
        checkpoint_level makes selective) the forward records its attention outputs and the
        recompute replays them, so attention runs once. The recompute context is entered once
        per recompute (a backward with retain_graph recomputes again), so each entry makes its
        contexts anew.
        """
        step = self._step
        masks = None if step is None else step.row_masks

        def routing() -> contextlib.AbstractContextManager:
            return self._routing(step, masks) if step is not None else contextlib.nullcontext()

        if self._levels is None or not self._levels.selective(index):
            return contextlib.nullcontext(), _EachEntry(routing)
        memo = AttentionMemo(arena=self.host_arena)
        return (self._using_memo(memo, memo.recording()),
                _EachEntry(lambda: self._using_memo(memo, routing(), memo.replay())))

    @contextlib.contextmanager
    def _using_memo(self, memo: AttentionMemo, *contexts: contextlib.AbstractContextManager) -> Iterator[None]:
        was, self._memo = self._memo, memo
        try:
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                yield
        finally:
            self._memo = was

    @contextlib.contextmanager
    def caller_counts_loss_tokens(self) -> Iterator[None]:
        """Inside, a Hugging Face model's `num_items_in_batch` is taken as the caller's own
        normalization (the transformers Trainer's, which is exact under CP) instead of refused."""
        was, self.caller_counts_tokens = self.caller_counts_tokens, True
        try:
            yield
        finally:
            self.caller_counts_tokens = was

    @contextlib.contextmanager
    def _routing(self, step: Step, masks: RowMasks) -> Iterator[None]:
        """`step` active, with its rows' `masks` (documents, hidden keys) as a forward saw them:
        attention computed across the CP group (SDPA calls, and Hugging Face layers, which ask cp_active)."""
        was = self._step, step.row_masks
        self._step, step.row_masks = step, masks
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(RouteSDPA(self.step_attention, cp_size=self.seq_size, passes_masks=self._passes_masks))
                if self.seq_size > 1:  # at cp_size 1 a model cpctl did not prepare sees the whole sequence
                    stack.enter_context(huggingface.unprepared_models_refused())
                yield
        finally:
            self._step, step.row_masks = was

    def _passes_masks(self) -> bool:
        """Whether an SDPA call with a tensor mask may run as it is: at cp_size 1 the mask covers the
        whole sequence, unless this step's documents would have to be added to it."""
        return self.seq_size == 1 and self._current_step().row_masks == (None, None)

    def prepare_dataloader(self, dataset, *, batch_size: int = 1, shuffle: bool = True, collate_fn=None,
                           seed: int = 0, **loader_kwargs) -> torch.utils.data.DataLoader:
        """A DataLoader whose batches differ across dp ranks and repeat across cp/tp ranks."""
        from torch.utils.data import IterableDataset

        if isinstance(dataset, IterableDataset):
            raise CpctlError("prepare_dataloader needs a map-style dataset (with __len__ and __getitem__) to split "
                             "it over dp ranks; for an IterableDataset, shard it by rt.dp_rank / rt.dp_size yourself")
        sampler = ResumableSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                     shuffle=shuffle, seed=seed, drop_last=True)
        return EpochDataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, **loader_kwargs)

    # ------------------------------------------------------------------ context parallelism

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's (load-balanced) shard of a full-length tensor, as a new tensor
        (with cp_size 1: the tensor itself, which is its whole shard)."""
        return self._current_step().shard(tensor, seq_dim=seq_dim)

    def unshard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Gather a sequence-sharded tensor back to full length, in original token order
        (without the tokens the step appended to make the length divide)."""
        return self._step_of(tensor, seq_dim, what="rt.unshard").unshard(tensor, seq_dim=seq_dim)

    def gather_padded(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """`unshard`, keeping the tokens appended at the end (as the shards hold them)."""
        return self._step_of(tensor, seq_dim, what="rt.unshard").gather_padded(tensor, seq_dim=seq_dim)

    def _step_of(self, tensor: torch.Tensor, seq_dim: int, *, what: str) -> Step:
        """The step whose layout the sharded `tensor` is read in: the active one; outside any step the
        plain layout, unless `tensor` has the latest step's tokens per rank and that step placed them
        otherwise (packed documents, padding): refused, not guessed."""
        last = self._result_of(tensor, seq_dim)
        if last is not None:
            how = last.padding.describe() if last.padding is not None else "its packed documents were placed by cost"
            raise CpctlError(
                f"{what} after maybe_context_parallel of a tensor with the step's {last.local_length} tokens per "
                f"rank: {how}, which the plain layout outside the context does not know; use it inside the "
                "context, or gather it after the context with the step the context yields "
                "(`with rt.maybe_context_parallel(...) as step:`, then `step.unshard(tensor, seq_dim=...)`)")
        return self._current_step()

    def _result_of(self, tensor: torch.Tensor, seq_dim: int) -> Step | None:
        """Outside any step: the latest step, when `tensor` may be its result and its layout is not the plain one."""
        last = self.last_step
        if self._step is not None or last is None or last.is_plain or tensor.dim() <= seq_dim % max(tensor.dim(), 1):
            return None
        return last if tensor.shape[seq_dim] == last.local_length else None

    @property
    def padding(self) -> padding.EndPadding | None:
        """The tokens this step appended so that the layout divides its length (None: none, or outside a step)."""
        return self._current_step().padding

    def appended_in_shard(self, local_len: int, *, device: torch.device | None = None) -> torch.Tensor | None:
        """Which of this rank's `local_len` tokens were appended by the step's padding (None: none)."""
        return self._current_step().appended_in_shard(local_len, device=device or self.device)

    def hide_keys(self, rows: HiddenKeys) -> None:
        """The padding of the batch the running forward computes: per row, the [start, stop) ranges
        of positions that no query sees (inside a step; see `Step.hide_keys`)."""
        if self._step is not None:
            self._step.hide_keys(rows)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
                  chunk: int | None = None, documents: Sequence[Sequence[int]] | None = None,
                  hidden_keys: HiddenKeys = None) -> torch.Tensor:
        """CP attention on already-sharded (batch, heads, local_seq, head_dim) tensors.

        `window`: each query sees the `window` keys ending at itself (and as many after it when
        not causal); `chunk`: only keys of its own `chunk`-token chunk (Llama 4); `documents`:
        per batch row, the start of every packed document; queries see only their own;
        `hidden_keys`: per batch row, [start, stop) ranges of keys no query sees (padding).
        """
        def compute() -> torch.Tensor:
            # cp_size 1 too: the same plan and kernels over a group of one (no collectives), so
            # windows and documents skip what they hide and no mask is built.
            self.attention_calls += 1
            if self.sp_size > 1:
                return ulysses_attention(
                    q, k, v, sp_group=self.axes["sp"].get_group(), cp_group=self.cp_group, ring_layout=self.ring_layout,
                    strategy=self.config.parallelism.cp_comm_strategy, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, window=window, chunk=chunk, documents=documents, hidden_keys=hidden_keys)
            return context_parallel_attention(
                q, k, v, group=self.cp_group, layout=self.layout, strategy=self.config.parallelism.cp_comm_strategy,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window, chunk=chunk,
                documents=documents, hidden_keys=hidden_keys)

        return self._memo.call(compute) if self._memo is not None else compute()

    def step_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        """`attention` with this step's packed documents and padding: what routed calls inside the context get."""
        step = self._current_step()
        return self.attention(q, k, v, documents=step.documents, hidden_keys=step.hidden_keys, **options)

    def require_sharded(self, tensor: torch.Tensor | None, *, name: str, seq_dim: int) -> None:
        """Inside maybe_context_parallel: `tensor` must have this step's local length along `seq_dim`."""
        if self._step is not None:
            self._step.require_sharded(tensor, name=name, seq_dim=seq_dim)

    def adopt_position_ids(self, position_ids: torch.Tensor) -> None:
        """Sharded position ids that a model is called with: where they restart, documents are packed.

        With `maybe_context_parallel(documents=...)` they must agree with it; without, their
        documents are computed exactly on this step's (head-tail) layout.
        """
        step = self._step
        if step is None:
            return  # outside a step there are no documents to keep
        rows = packing.documents_or_none(packing.starts_per_row(step.unshard(position_ids, seq_dim=-1)))
        if step.documents is None:
            step.documents = rows
        elif not _same_documents(rows or [(0,)], step.documents):
            raise CpctlError("the model's position_ids and maybe_context_parallel(documents=...) place documents "
                             "differently; pass the same position ids to both")

    def shift_sharded(self, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of a sharded (batch, local_seq) tensor, as `cpctl.shift_labels` gives
        them on the full sequence: each chunk's last token takes the next chunk's first."""
        if self.seq_size == 1:
            from cpctl.runtime.data import shift_labels

            return shift_labels(labels, ignore_index=ignore_index)
        layout = self._step_of(labels, 1, what="rt.shift_sharded").layout
        chunk_len = labels.shape[1] // len(layout.local_chunks)
        firsts = labels[:, ::chunk_len].contiguous()  # (batch, local chunks)
        gathered = [torch.empty_like(firsts) for _ in range(self.seq_size)]
        dist.all_gather(gathered, firsts, group=self.seq_group)
        first_of = {chunk: gathered[rank][:, pos] for rank in range(self.seq_size)
                    for pos, chunk in enumerate(layout.chunks_of(rank))}
        shifted = torch.full_like(labels, ignore_index)
        for pos, chunk in enumerate(layout.local_chunks):
            start, stop = pos * chunk_len, (pos + 1) * chunk_len
            shifted[:, start:stop - 1] = labels[:, start + 1:stop]
            if chunk + 1 < layout.num_chunks:
                shifted[:, stop - 1] = first_of[chunk + 1]
        return shifted

    @contextlib.contextmanager
    def maybe_context_parallel(self, *, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                               no_restore_buffers: Iterable[torch.Tensor] = (),
                               documents: torch.Tensor | None = None,
                               pad_values: Sequence[padding.PadValue] | None = None) -> Iterator[Step]:
        """Shard `buffers` in place along their sequence dims and compute every SDPA call
        across the CP group; on exit restore the buffers not in `no_restore_buffers`.
        Enter it anew every step. It yields the step (cpctl.runtime.step): the runtime holds it
        while the body runs; after the context, `step.unshard` gathers the step's results.

        With cp_size and sp_size 1 the shard is the whole sequence (the buffers are left as they
        are), and attention is computed by the same engine over a group of one: the same masks,
        plans and kernels as under CP, without collectives.

        `documents`: full-length position ids (batch, seq) that restart at each packed
        document (as transformers' DataCollatorWithFlattening makes them): attention stays
        inside documents, and the chunks are assigned to ranks by cost.

        A length the layout does not divide is padded at the end (cpctl.runtime.padding): the
        appended tokens count for nothing, and restored buffers and `rt.unshard` (inside) drop them.
        `pad_values` (one per buffer: a number, "positions", or None for cpctl's rule) says
        what to append where the rule would guess wrong.
        """
        buffers, no_restore = list(buffers), list(no_restore_buffers)
        guards.check_buffers(buffers, list(buffer_seq_dims), no_restore)
        padding.check_values(None if pad_values is None else list(pad_values), buffers=len(buffers))
        if documents is not None and not isinstance(documents, torch.Tensor):
            raise CpctlError("maybe_context_parallel: documents must be a tensor of position ids, "
                             "e.g. cpctl.position_ids_for_documents(lengths)")
        if self.seq_size > 1:
            self._check_same_inputs(buffers if documents is None else [*buffers, documents])
        seq_len = buffers[0].shape[buffer_seq_dims[0]] if buffers else None
        if documents is not None and seq_len is not None and documents.shape[-1] != seq_len:
            raise CpctlError(f"maybe_context_parallel: documents has {documents.shape[-1]} positions but the "
                             f"first buffer {seq_len} tokens; pass the full-length position ids")
        if seq_len is None:
            seq_len = documents.shape[-1] if documents is not None else 0
        step = Step(self.split, group=self.seq_group, seq_len=seq_len, documents=documents)
        self._log_balance(step)
        step.enter(buffers, seq_dims=list(buffer_seq_dims), no_restore=no_restore,
                   pad_values=None if pad_values is None else list(pad_values))
        self.last_step = step
        try:
            with self._routing(step, step.row_masks):
                yield step
        finally:
            step.exit()

    def require_ignored_tail(self, labels: torch.Tensor, *, ignore_index: int = -100, what: str) -> None:
        """The appended tokens' labels must be ignored, or `what` would count them (on every CP rank together).
        After the context, labels that may be the latest step's are checked against its padding."""
        step = self._result_of(labels, -1) or self._current_step()
        appended = step.appended_in_shard(labels.shape[-1], device=labels.device)
        if appended is None:
            return
        counted = bool((labels[..., appended] != ignore_index).any())
        self.raise_together(
            f"{what} counts the tokens appended at the end ({step.padding.describe()} to split over the CP "
            f"ranks): their labels are not {ignore_index}; build labels that end with {ignore_index} "
            "(cpctl.shift_labels), pass pad_values with -100 for them, or make the length a multiple of "
            f"{step.layout.num_chunks}" if counted else None)

    def _log_balance(self, step: Step) -> None:
        """How packed documents are spread: once at INFO (the run's log says it), then per step at DEBUG."""
        placed = step.placement
        if placed is None or not self.is_main:
            return
        level = logging.DEBUG if self._balance_logged else logging.INFO
        self._balance_logged = True
        _log.log(level, "packed documents: %d chunks per rank assigned by cost; attention work max/mean %.3f "
                 "(head-tail chunks: %.3f)", len(placed.layout.local_chunks), placed.balance, placed.head_tail_balance)

    def _check_same_inputs(self, buffers: list[torch.Tensor]) -> None:
        """Every rank of a CP group must hold the same full buffers: compare cheap fingerprints."""
        mine = guards.fingerprints(buffers).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.seq_size)]
        dist.all_gather(gathered, mine, group=self.seq_group)
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
        dist.all_reduce(flag, group=self.seq_group)
        if not int(flag.item()):
            return
        problems = [None] * self.seq_size
        dist.all_gather_object(problems, problem, group=self.seq_group)
        rank, first = next((r, p) for r, p in enumerate(problems) if p is not None)
        raise CpctlError(first if problem is not None else f"CP rank {self.cp_rank_to_global(rank)}: {first}")

    def cp_rank_to_global(self, cp_rank: int) -> int:
        """The global rank of a rank of the sequence group (the cp group when sp_size is 1)."""
        return dist.get_process_group_ranks(self.seq_group)[cp_rank]

    # ------------------------------------------------------------------ losses

    def token_mean(self, loss_sum: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """The token-mean loss of the whole dp x cp batch, from this rank's summed loss (see losses.token_mean)."""
        self.require_sharded(labels, name="token_mean's labels", seq_dim=1 if labels.dim() > 1 else 0)
        self.require_ignored_tail(labels, ignore_index=ignore_index, what="rt.token_mean's loss")
        return losses.token_mean(loss_sum, labels, group=self.axes["dp_cp"], ignore_index=ignore_index)

    def causal_lm_loss(self, model: nn.Module, *, input_ids: torch.Tensor, labels: torch.Tensor,
                       **kwargs: Any) -> torch.Tensor:
        """A Hugging Face causal LM's loss (the global token mean, as model(labels=...).loss would be
        without CP) that never holds the full logits: chunks of memory.loss_chunk_tokens tokens.
        `labels` unshifted, as transformers takes them; under CP sharded like input_ids."""
        for name, tensor in (("input_ids", input_ids), ("labels", labels)):
            self.require_sharded(tensor, name=f"causal_lm_loss's {name}", seq_dim=1)
        appended = self.appended_in_shard(labels.shape[1], device=labels.device) if self.cp_active else None
        if appended is not None:  # labels by name: the appended tokens are ignored
            labels = labels.masked_fill(appended, huggingface.IGNORE_INDEX)
        return huggingface.causal_lm_loss(model, self, input_ids=input_ids, labels=labels,
                                          chunk_tokens=self.config.memory.loss_chunk_tokens, **kwargs)

    def document_mean(self, token_losses: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, *,
                      ignore_index: int = -100) -> torch.Tensor:
        """The mean over every packed document of the dp x cp batch of its own token-mean loss
        (see losses.document_mean); inputs are this rank's (batch, local_seq) shards."""
        for name, tensor in (("labels", labels), ("position_ids", position_ids)):
            self.require_sharded(tensor, name=f"document_mean's {name}", seq_dim=1)
        self.require_ignored_tail(labels, ignore_index=ignore_index, what="rt.document_mean's loss")
        step = self._step_of(position_ids, 1, what="rt.document_mean")
        full_positions = step.unshard(position_ids, seq_dim=1)
        positions = torch.arange(full_positions.shape[1], device=labels.device).expand_as(full_positions)
        return losses.document_mean(token_losses, labels, starts=packing.starts_per_row(full_positions),
                                    token_positions=step.shard(positions, seq_dim=1), cp=self.axes["cp_sp"],
                                    dp=self.axes["dp"], dp_cp=self.axes["dp_cp"], ignore_index=ignore_index)


class _EachEntry(contextlib.AbstractContextManager):
    """A context that can be entered again: each entry enters a new one from `make`."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make, self.entered = make, []

    def __enter__(self) -> Any:
        context = self.make()
        self.entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc_info)


def _same_documents(a: list, b: list) -> bool:
    """Per-row document starts, one row standing for every row of the batch."""
    rows = max(len(a), len(b))
    return (a * rows if len(a) == 1 else a) == (b * rows if len(b) == 1 else b)


# ---------------------------------------------------------------------- init

_log = logging.getLogger("cpctl")
_RUNTIME: Runtime | None = None
_INIT_OVERRIDES: dict[str, Any] = {}


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
        process.start(device, on_exit=_forget_runtime, timeout_s=profile.launch.comm_timeout)
    mesh, axes = build_mesh(profile.parallelism, device_type=device.type)
    process.apply_timeout([axis.get_group() for axis in axes.values() if axis.ndim == 1])
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


def _forget_runtime() -> None:
    global _RUNTIME
    _RUNTIME = None
