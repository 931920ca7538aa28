"""The per-step context: which step's body runs, and everything that reads it.

`maybe_context_parallel` makes a `Step` (runtime/step.py) and holds it here while its body runs
(and while a checkpointed block of it recomputes): SDPA calls are routed to the CP engine,
shards, gathers and checks use its layout and padding, packed documents are read into it.
Outside any step the plain layout holds.

This is the object integrations are handed (it satisfies `integrations.runtime_view.RuntimeView`):
its plumbing (`step_attention`, `adopt_position_ids`, `hide_keys`, ...) is theirs, not the
user's `Runtime`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cpctl.config import Profile
from cpctl.attention import context_parallel_attention
from cpctl.attention.dispatch import RouteSDPA
from cpctl.attention.ulysses import ulysses_attention
from cpctl.errors import CpctlError
from cpctl.runtime import adapters, guards, padding
from cpctl.runtime import documents as packing
from cpctl.runtime.mesh import Axis, ParallelMesh
from cpctl.runtime.pinned import HostArena
from cpctl.runtime.selective import AttentionMemo
from cpctl.runtime.step import HiddenKeys, RowMasks, SequenceSplit, Step

_log = logging.getLogger("cpctl")


class StepContext:
    """The step whose body runs on this rank (none outside), and the latest one entered."""

    config: Profile
    mesh: ParallelMesh
    device: torch.device
    last_step: Step | None
    caller_counts_tokens: bool
    attention_calls: int

    def __init__(self, config: Profile, mesh: ParallelMesh, device: torch.device) -> None:
        self.config, self.mesh, self.device = config, mesh, device
        self.last_step: Step | None = None  # after its context, its results are gathered with it
        self.caller_counts_tokens = False  # inside caller_counts_loss_tokens(): a model may take num_items_in_batch
        self.attention_calls = 0  # calls of the CP engine so far (a model's attention can be seen to go through it)
        self._step: Step | None = None  # the step whose body runs (or whose checkpointed block recomputes)
        self._plain: Step | None = None  # what holds outside any step (the plain layout), made once
        self._memo: AttentionMemo | None = None  # the checkpointed block whose attention outputs are kept (selective)
        self._balance_logged = False

    # ------------------------------------------------------------------ where the step stands

    @property
    def sp_size(self) -> int:
        return self.mesh.sp_size

    @property
    def seq_size(self) -> int:
        return self.mesh.seq_size

    @property
    def seq_group(self) -> dist.ProcessGroup:
        return self.mesh.seq_group

    @property
    def cp_active(self) -> bool:
        """Inside maybe_context_parallel's routing (at every cp size, 1 included)."""
        return self._step is not None

    @property
    def split(self) -> SequenceSplit:
        """Where this rank sits among the ranks that split one sequence."""
        mesh = self.mesh
        return SequenceSplit(cp_size=mesh.cp_size, cp_rank=mesh.cp_rank, sp_size=mesh.sp_size, sp_rank=mesh.sp_rank,
                             load_balance=self.config.parallelism.cp_load_balance)

    def current_step(self) -> Step:
        """The step whose body runs, else the plain layout that holds outside any step."""
        if self._step is not None:
            return self._step
        if self._plain is None:
            self._plain = Step.plain(self.split, group=self.seq_group)
        return self._plain

    @property
    def padding(self) -> padding.EndPadding | None:
        """The tokens this step appended so that the layout divides its length (None: none, or outside a step)."""
        return self.current_step().padding

    # ------------------------------------------------------------------ entering a step

    @contextlib.contextmanager
    def maybe_context_parallel(self, *, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                               no_restore_buffers: Iterable[torch.Tensor] = (),
                               documents: torch.Tensor | None = None,
                               pad_values: Sequence[padding.PadValue] | None = None) -> Iterator[Step]:
        """`Runtime.maybe_context_parallel`: a step built, entered, routed while its body runs, exited."""
        buffers, no_restore = list(buffers), list(no_restore_buffers)
        guards.check_buffers(buffers, list(buffer_seq_dims), no_restore)
        padding.check_values(None if pad_values is None else list(pad_values), buffers=len(buffers))
        if documents is not None and not isinstance(documents, torch.Tensor):
            raise CpctlError("maybe_context_parallel: documents must be a tensor of position ids, "
                             "e.g. cpctl.position_ids_for_documents(lengths)")
        if self.mesh.seq_enabled:
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

    def _log_balance(self, step: Step) -> None:
        """How packed documents are spread: once at INFO (the run's log says it), then per step at DEBUG."""
        placed = step.placement
        if placed is None or dist.get_rank() != 0:
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
                    f"maybe_context_parallel: CP ranks {self.mesh.seq_rank_to_global(0)} and "
                    f"{self.mesh.seq_rank_to_global(rank)} got different inputs ({what} differs); every rank of a "
                    "CP group must get the same batch: load data with rt.prepare_dataloader, or seed every rank alike"
                )

    @contextlib.contextmanager
    def _routing(self, step: Step, masks: RowMasks) -> Iterator[None]:
        """`step` active, with its rows' `masks` (documents, hidden keys) as a forward saw them:
        attention computed across the CP group (SDPA calls, and adapted models, which ask cp_active)."""
        was = self._step, step.row_masks
        self._step, step.row_masks = step, masks
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(RouteSDPA(self.step_attention, cp_size=self.seq_size, passes_masks=self._passes_masks,
                                              local_tokens=step.local_length))
                if self.mesh.seq_enabled:  # at cp_size 1 a model cpctl did not prepare sees the whole sequence
                    stack.enter_context(adapters.unprepared_models_refused())
                yield
        finally:
            self._step, step.row_masks = was

    def _passes_masks(self) -> bool:
        """Whether an SDPA call with a tensor mask may run as it is: at cp_size 1 the mask covers the
        whole sequence, unless this step's documents would have to be added to it."""
        return not self.mesh.seq_enabled and self.current_step().row_masks == (None, None)

    # ------------------------------------------------------------------ checkpointed blocks

    def block_contexts(self, *, selective: bool, arena: HostArena | None
                       ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The contexts around a checkpointed block's forward and its recompute, at each call.

        The recompute is routed as the forward was; at the selective level the forward records
        its attention outputs and the recompute replays them, so attention runs once. The
        recompute context is entered once per recompute (a backward with retain_graph recomputes
        again), so each entry makes its contexts anew.
        """
        step = self._step
        masks = None if step is None else step.row_masks

        def routing() -> contextlib.AbstractContextManager:
            return self._routing(step, masks) if step is not None else contextlib.nullcontext()

        if not selective:
            return contextlib.nullcontext(), _EachEntry(routing)
        memo = AttentionMemo(arena=arena)
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

    # ------------------------------------------------------------------ shards and gathers

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return self.current_step().shard(tensor, seq_dim=seq_dim)

    def unshard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return self.step_of(tensor, seq_dim, what="rt.unshard").unshard(tensor, seq_dim=seq_dim)

    def gather_padded(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """`unshard`, keeping the tokens appended at the end (as the shards hold them)."""
        return self.step_of(tensor, seq_dim, what="rt.unshard").gather_padded(tensor, seq_dim=seq_dim)

    def step_of(self, tensor: torch.Tensor, seq_dim: int, *, what: str) -> Step:
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
        return self.current_step()

    def _result_of(self, tensor: torch.Tensor, seq_dim: int) -> Step | None:
        """Outside any step: the latest step, when `tensor` may be its result and its layout is not the plain one."""
        last = self.last_step
        if self._step is not None or last is None or last.is_plain or tensor.dim() <= seq_dim % max(tensor.dim(), 1):
            return None
        return last if tensor.shape[seq_dim] == last.local_length else None

    def appended_in_shard(self, local_len: int, *, device: torch.device | None = None) -> torch.Tensor | None:
        """Which of this rank's `local_len` tokens were appended by the step's padding (None: none)."""
        return self.current_step().appended_in_shard(local_len, device=device or self.device)

    def shift_sharded(self, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of a sharded (batch, local_seq) tensor, as `cpctl.shift_labels` gives
        them on the full sequence: each chunk's last token takes the next chunk's first."""
        if not self.mesh.seq_enabled:
            from cpctl.runtime.data import shift_labels

            return shift_labels(labels, ignore_index=ignore_index)
        layout = self.step_of(labels, 1, what="rt.shift_sharded").layout
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

    # ------------------------------------------------------------------ what a forward tells the step

    def hide_keys(self, rows: HiddenKeys) -> None:
        """The padding of the batch the running forward computes: per row, the [start, stop) ranges
        of positions that no query sees (inside a step; see `Step.hide_keys`)."""
        if self._step is not None:
            self._step.hide_keys(rows)

    def adopt_position_ids(self, position_ids: torch.Tensor) -> bool:
        """Sharded position ids that a model is called with: where they restart, documents are packed.

        With `maybe_context_parallel(documents=...)` they must agree with it; without, their
        documents are computed exactly on this step's (head-tail) layout. Returns whether they
        placed the step's documents (they restart, and nothing had placed them before).
        """
        step = self._step
        if step is None:
            return False  # outside a step there are no documents to keep
        rows = packing.documents_or_none(packing.starts_per_row(step.unshard(position_ids, seq_dim=-1)))
        if step.documents is None:
            step.documents = rows
            return rows is not None
        if not same_documents(rows or [(0,)], step.documents):
            raise CpctlError("the model's position_ids and maybe_context_parallel(documents=...) place documents "
                             "differently; pass the same position ids to both")
        return False

    # ------------------------------------------------------------------ attention

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
                  chunk: int | None = None, documents: Sequence[Sequence[int]] | None = None,
                  hidden_keys: HiddenKeys = None) -> torch.Tensor:
        """`Runtime.attention`: CP attention on already-sharded tensors, through the engine at
        every cp size (1 too: the same plan and kernels over a group of one, no collectives)."""
        def compute() -> torch.Tensor:
            self.attention_calls += 1
            strategy = self.config.parallelism.cp_comm_strategy
            if self.mesh.sp_enabled:
                return ulysses_attention(
                    q, k, v, sp_group=self.mesh.group(Axis.SP), cp_group=self.mesh.group(Axis.CP),
                    ring_layout=self.current_step().ring_layout, strategy=strategy, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, window=window, chunk=chunk, documents=documents, hidden_keys=hidden_keys)
            return context_parallel_attention(
                q, k, v, group=self.mesh.group(Axis.CP), layout=self.current_step().layout, strategy=strategy,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window, chunk=chunk,
                documents=documents, hidden_keys=hidden_keys)

        return self._memo.call(compute) if self._memo is not None else compute()

    def step_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        """`attention` with this step's packed documents and padding: what routed calls inside the context get."""
        step = self.current_step()
        return self.attention(q, k, v, documents=step.documents, hidden_keys=step.hidden_keys, **options)

    # ------------------------------------------------------------------ checks

    def require_sharded(self, tensor: torch.Tensor | None, *, name: str, seq_dim: int) -> None:
        """Inside maybe_context_parallel: `tensor` must have this step's local length along `seq_dim`."""
        if self._step is not None:
            self._step.require_sharded(tensor, name=name, seq_dim=seq_dim)

    def require_ignored_tail(self, labels: torch.Tensor, *, ignore_index: int = -100, what: str) -> None:
        """The appended tokens' labels must be ignored, or `what` would count them (on every CP rank together).
        After the context, labels that may be the latest step's are checked against its padding."""
        step = self._result_of(labels, -1) or self.current_step()
        appended = step.appended_in_shard(labels.shape[-1], device=labels.device)
        if appended is None:
            return
        counted = bool((labels[..., appended] != ignore_index).any())
        self.raise_together(
            f"{what} counts the tokens appended at the end ({step.padding.describe()} to split over the CP "
            f"ranks): their labels are not {ignore_index}; build labels that end with {ignore_index} "
            "(cpctl.shift_labels), pass pad_values with -100 for them, or make the length a multiple of "
            f"{step.layout.num_chunks}" if counted else None)

    def every_seq_rank(self, holds: bool) -> bool:
        """Whether `holds` is true on every rank of this rank's CP group (a collective: all call it)."""
        flag = torch.tensor([1 if holds else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.seq_group)
        return bool(flag.item())

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
        raise CpctlError(first if problem is not None else f"CP rank {self.mesh.seq_rank_to_global(rank)}: {first}")


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


def same_documents(a: list, b: list) -> bool:
    """Per-row document starts, one row standing for every row of the batch."""
    rows = max(len(a), len(b))
    return (a * rows if len(a) == 1 else a) == (b * rows if len(b) == 1 else b)
