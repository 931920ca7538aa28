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
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpctl import profile as profiles
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

    config: profiles.Profile
    mesh: DeviceMesh
    device: torch.device
    axes: dict[str, DeviceMesh]  # every axis by name, flattened ones included
    _cp_active: bool = False  # inside maybe_context_parallel

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
    def layout(self) -> ChunkLayout:
        return ChunkLayout(cp_size=self.cp_size, cp_rank=self.cp_rank,
                           load_balance=self.config.parallelism.cp_load_balance)

    # ------------------------------------------------------------------ model and data

    def prepare_model(self, model: nn.Module, *, tp_plan: dict | None = None,
                      blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move to the device, apply TP (tp_size > 1), activation checkpointing and FSDP2.

        `blocks` are the modules to shard one by one (default: the children of the model's
        largest ModuleList, e.g. `model.layers`).
        """
        model = model.to(self.device)
        if self.config.parallelism.tp_size > 1:
            apply_tensor_parallel(model, tp_mesh=self.axes["tp"], tp_plan=tp_plan)
        found = list(blocks) if blocks is not None else find_blocks(model)
        if self.config.fsdp.activation_checkpointing:
            apply_activation_checkpointing(found, model, recompute_context=self._recompute_context)
            found = find_blocks(model) if blocks is None else found
        if self.config.fsdp.version == 2:
            apply_fsdp(model, mesh=self._fsdp_mesh(), fsdp=self.config.fsdp, blocks=found)
        elif self.axes["dp_cp"].size() > 1:
            # Without a gradient reduction the ranks would drift apart, and token_mean's scaling
            # (which expects the average over dp x cp ranks) would be wrong.
            raise CpctlError(
                "fsdp.version: 1 with several data-parallel ranks; cpctl's prepare_model applies FSDP2 only: "
                "set fsdp.version: 2 (or wrap the model in DDP/FSDP yourself and skip prepare_model)"
            )
        return model

    def _recompute_context(self) -> contextlib.AbstractContextManager:
        """Called in a checkpointed block's forward: route its recompute as the forward was routed."""
        return RouteSDPA(self.attention) if self._cp_active else contextlib.nullcontext()

    def _fsdp_mesh(self) -> DeviceMesh:
        if self.config.parallelism.dp_replicate_size > 1:
            return self.mesh["dp_replicate", "dp_shard_cp"]  # HSDP: replicate x shard
        return self.axes["dp_shard_cp"]

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
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """CP attention on already-sharded (batch, heads, local_seq, head_dim) tensors."""
        if self.cp_size == 1:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return context_parallel_attention(
            q, k, v, group=self.cp_group, layout=self.layout, strategy=self.config.parallelism.cp_comm_strategy,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    @contextlib.contextmanager
    def maybe_context_parallel(self, *, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                               no_restore_buffers: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Shard `buffers` in place along their sequence dims and compute every SDPA call
        across the CP group; on exit restore the buffers not in `no_restore_buffers`.
        Enter it anew every step. With cp_size 1 it does nothing."""
        buffers, no_restore = list(buffers), list(no_restore_buffers)
        _check_buffers(buffers, list(buffer_seq_dims), no_restore)
        if self.cp_size == 1:
            yield
            return
        originals = []
        with torch.no_grad():
            # Every shard first (each checks its length), so a bad buffer leaves none half-done.
            shards = [sharding.shard(b, seq_dim=d, layout=self.layout) for b, d in zip(buffers, buffer_seq_dims)]
            for buffer, local in zip(buffers, shards):
                keep = not any(buffer is t for t in no_restore)
                originals.append(_alias(buffer) if keep else None)
                buffer.set_(local)
        self._cp_active = True
        try:
            with RouteSDPA(self.attention):
                yield
        finally:
            self._cp_active = False
            with torch.no_grad():
                for buffer, original in zip(buffers, originals):
                    if original is not None:
                        buffer.set_(original)

    # ------------------------------------------------------------------ losses

    def token_mean(self, loss_sum: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """The token-mean loss of the whole dp x cp batch, from this rank's summed loss.

        Its value is the global mean on every rank. Its gradient is this rank's share scaled
        so that, after FSDP averages gradients over the dp_replicate x dp_shard x cp ranks,
        every parameter holds the single-process gradient of the global token mean.
        """
        group = self.axes["dp_cp"].get_group()
        stats = torch.stack([loss_sum.detach().float(), (labels != ignore_index).sum().float()])
        dist.all_reduce(stats, group=group)
        total_loss, total_tokens = stats[0], stats[1].clamp(min=1)
        averaging = self.axes["dp_cp"].size()  # FSDP's gradient reduction divides by this
        share = loss_sum * (averaging / total_tokens)
        return share + (total_loss / total_tokens - share).detach()


class EpochDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose every pass is a new epoch: its DistributedSampler reshuffles."""

    _epoch = 0

    def __iter__(self):
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return super().__iter__()


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
    config = _profile_for_this_process(overrides)
    device = _device_for(config)
    if not dist.is_initialized():
        _init_process_group(device)
        atexit.register(_shutdown)
    mesh, axes = build_mesh(config.parallelism, device_type=device.type)
    _RUNTIME, _INIT_OVERRIDES = Runtime(config=config, mesh=mesh, device=device, axes=axes), dict(overrides)
    return _RUNTIME


def _profile_for_this_process(overrides: dict[str, Any]) -> profiles.Profile:
    by_leaf = {spec.leaf: spec.path for spec in profiles.FIELDS.values()}
    unknown = [key for key in overrides if key not in by_leaf]
    if unknown:
        raise CpctlError(f"cpctl.init({unknown[0]}=...): unknown profile key; known: {', '.join(sorted(by_leaf))}")
    passed = os.environ.get(profiles.PROFILE_ENV_VAR)
    if passed:  # from `cpctl launch`: already resolved and validated there
        tree = json.loads(passed)
        layer, _ = profiles.text_layer({by_leaf[key]: str(value) for key, value in overrides.items()},
                                       source_of=lambda spec: f"cpctl.init({spec.leaf}=...)")
        for section, values in layer.items():
            if isinstance(values, dict):
                tree.setdefault(section, {}).update(values)
            else:
                tree[section] = values
        machine = profiles.Machine(cuda_devices=torch.cuda.device_count())
        config, _ = profiles.fill_auto(profiles.from_dict(tree, source=profiles.PROFILE_ENV_VAR), machine=machine)
        profiles.validate(config)
        return config
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    flags: dict[str, Any] = {"launch.nproc_per_node": str(local_world), "launch.nnodes": str(world // local_world)}
    if world == 1:  # plain `python script.py`: nothing to parallelise
        flags.update({f"parallelism.{k}": "1" for k in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")})
    if world > local_world:
        flags["launch.rdzv_endpoint"] = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '29500')}"
    flags.update({by_leaf[key]: str(value) for key, value in overrides.items()})
    environ = {k: v for k, v in os.environ.items() if k != profiles.PROFILE_ENV_VAR}
    return profiles.resolve(flags=flags, environ=environ).profile


def _device_for(config: profiles.Profile) -> torch.device:
    if config.launch.device == "cuda":
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


def _shutdown() -> None:
    global _RUNTIME
    _RUNTIME = None
    if dist.is_initialized():
        dist.destroy_process_group()
