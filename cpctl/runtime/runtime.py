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
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpctl import config
from cpctl.attention import ChunkLayout
from cpctl.errors import CpctlError
from cpctl.runtime import loading, process, step_losses
from cpctl.runtime.padding import EndPadding, PadValue
from cpctl.runtime.context import StepContext
from cpctl.runtime.loader import EpochDataLoader, ResumableSampler
from cpctl.runtime.mesh import Axes, ParallelMesh
from cpctl.runtime.pinned import HostArena
from cpctl.runtime.preparation import ModelPreparation
from cpctl.runtime.step import HiddenKeys, Step
from cpctl.versions import require_torch


class Runtime:
    """One process's view of the parallel job. Build it with `cpctl.init()`.

    Its members are the API docs/runtime.md documents; each is answered by the part that owns it:
    the mesh (runtime/mesh.py), the step context (runtime/context.py), the model preparation
    (runtime/preparation.py) and the step's losses (runtime/step_losses.py).
    """

    def __init__(self, profile: config.Profile, mesh: ParallelMesh, device: torch.device) -> None:
        self._context = StepContext(profile, mesh, device)
        self._preparation = ModelPreparation(self._context)

    # ------------------------------------------------------------------ the job and this rank's place in it

    @property
    def config(self) -> config.Profile:
        return self._context.config

    @property
    def mesh(self) -> DeviceMesh:
        """The root mesh: axes dp_replicate, dp_shard, cp, sp, tp."""
        return self._context.mesh.root

    @property
    def axes(self) -> Axes:
        """Every axis as a mesh, flattened ones included: `rt.axes["cp"]`, `rt.axes["dp_cp"]`."""
        return self._context.mesh.axes

    @property
    def device(self) -> torch.device:
        return self._context.device

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
        return self._context.mesh.cp_size

    @property
    def cp_rank(self) -> int:
        return self._context.mesh.cp_rank

    @property
    def sp_size(self) -> int:
        return self._context.mesh.sp_size

    @property
    def sp_rank(self) -> int:
        return self._context.mesh.sp_rank

    @property
    def seq_size(self) -> int:
        return self._context.mesh.seq_size

    @property
    def seq_group(self) -> dist.ProcessGroup:
        return self._context.mesh.seq_group

    @property
    def dp_size(self) -> int:
        return self._context.mesh.dp_size

    @property
    def dp_rank(self) -> int:
        return self._context.mesh.dp_rank

    # ------------------------------------------------------------------ model and data

    def prepare_model(self, model: nn.Module, *, tp_plan: dict | None = None,
                      blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move to the device, apply TP (tp_size > 1), activation checkpointing and FSDP2
        (runtime/preparation.py). `blocks` are the modules to shard one by one (default: the
        children of the model's largest ModuleList, e.g. `model.layers`)."""
        return self._preparation.prepare(model, tp_plan=tp_plan, blocks=blocks)

    def from_pretrained(self, model_class: Any, path: str | os.PathLike, *, tp_plan: dict | None = None,
                        **kwargs: Any) -> nn.Module:
        """`model_class.from_pretrained(path, **kwargs)` prepared as prepare_model does, without a
        full copy of the weights on any rank: built on the meta device, sharded, then each rank
        reads its shards' slices of the local safetensors files (runtime/loading.py). Collective.

        `model_class` is a transformers class (`AutoModelForCausalLM`, `LlamaForCausalLM`);
        `kwargs` go to it as to from_pretrained (`attn_implementation`, `dtype`). Like
        from_pretrained it returns the model in eval mode: call `model.train()` to train."""
        model, tied = loading.build_on_meta(model_class, path, **kwargs)
        dtypes = loading.built_dtypes(model)
        model = self.prepare_model(model, tp_plan=tp_plan)
        loading.load_weights(model, path, device=self.device, tied=tied, dtypes=dtypes)
        return model.eval()

    @property
    def host_arena(self) -> HostArena | None:
        """Where offloaded activations wait for backward (with memory.offload_activations): its
        `peak_bytes` is the host memory they took, `cpctl plan`'s "pinned host memory"."""
        return self._preparation.host_arena

    @property
    def selective_blocks(self) -> int | None:
        """How many checkpointed blocks (the last ones) keep attention's tensors, as of the last
        step (memory.checkpoint_level); None without activation checkpointing."""
        return self._preparation.selective_blocks

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

    def maybe_context_parallel(self, *, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                               no_restore_buffers: Iterable[torch.Tensor] = (),
                               documents: torch.Tensor | None = None,
                               pad_values: Sequence[PadValue] | None = None
                               ) -> contextlib.AbstractContextManager[Step]:
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
        return self._context.maybe_context_parallel(buffers=buffers, buffer_seq_dims=buffer_seq_dims,
                                                    no_restore_buffers=no_restore_buffers, documents=documents,
                                                    pad_values=pad_values)

    @property
    def last_step(self) -> Step | None:
        """The latest step entered: after its context, its results are gathered with it."""
        return self._context.last_step

    @property
    def cp_balance(self) -> float | None:
        """The latest step's slowest CP rank's attention work / mean (packed documents; else None)."""
        return None if self.last_step is None else self.last_step.balance

    @property
    def layout(self) -> ChunkLayout:
        """The tokens this rank holds this step: the ring's chunks, each cut over the sp ranks (sp > 1)."""
        return self._context.current_step().layout

    @property
    def padding(self) -> EndPadding | None:
        """The tokens this step appended so that the layout divides its length (None: none, or outside a step)."""
        return self._context.padding

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's (load-balanced) shard of a full-length tensor, as a new tensor
        (with cp_size 1: the tensor itself, which is its whole shard)."""
        return self._context.shard(tensor, seq_dim)

    def unshard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Gather a sequence-sharded tensor back to full length, in original token order
        (without the tokens the step appended to make the length divide)."""
        return self._context.unshard(tensor, seq_dim)

    def shift_sharded(self, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of a sharded (batch, local_seq) tensor, as `cpctl.shift_labels` gives
        them on the full sequence: each chunk's last token takes the next chunk's first."""
        return self._context.shift_sharded(labels, ignore_index=ignore_index)

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
        return self._context.attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                       window=window, chunk=chunk, documents=documents, hidden_keys=hidden_keys)

    # ------------------------------------------------------------------ losses

    def token_mean(self, loss_sum: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """The token-mean loss of the whole dp x cp batch, from this rank's summed loss (see losses.token_mean)."""
        return step_losses.token_mean(self._context, loss_sum, labels, ignore_index=ignore_index)

    def document_mean(self, token_losses: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, *,
                      ignore_index: int = -100) -> torch.Tensor:
        """The mean over every packed document of the dp x cp batch of its own token-mean loss
        (see losses.document_mean); inputs are this rank's (batch, local_seq) shards."""
        return step_losses.document_mean(self._context, token_losses, labels, position_ids, ignore_index=ignore_index)

    def causal_lm_loss(self, model: nn.Module, *, input_ids: torch.Tensor, labels: torch.Tensor,
                       **kwargs: Any) -> torch.Tensor:
        """A Hugging Face causal LM's loss (the global token mean, as model(labels=...).loss would be
        without CP) that never holds the full logits: chunks of memory.loss_chunk_tokens tokens.
        `labels` unshifted, as transformers takes them; under CP sharded like input_ids."""
        return step_losses.causal_lm_loss(self._context, model, input_ids=input_ids, labels=labels, **kwargs)


def step_context(runtime: Runtime) -> StepContext:
    """What integrations are handed: the runtime's step context (its plumbing is not the user's API)."""
    return runtime._context


def preparation(runtime: Runtime) -> ModelPreparation:
    """The runtime's model preparation, for an integration that runs its steps around another library's FSDP."""
    return runtime._preparation


# ---------------------------------------------------------------------- init

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
    mesh = ParallelMesh.build(profile.parallelism, device_type=device.type)
    process.apply_timeout(mesh.groups())
    _RUNTIME, _INIT_OVERRIDES = Runtime(profile, mesh, device), dict(overrides)
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
