"""`rt.prepare_model`'s pipeline: every step a model goes through, in order, in one place.

1. refusals: a compiled model, a sharded one (prepared before), a quantized one;
2. its library's adapter (the one registered that knows it: runtime/adapters.py) routes its
   attention through cpctl, and hands over its own gradient checkpointing;
3. the device (buffers only for a model on meta: `rt.from_pretrained` fills the shards later);
4. tensor parallelism (tp > 1);
5. per block: tiled MLPs and norms, then checkpoint levels and activation checkpointing;
6. FSDP2 over the fsdp mesh, and the guard against parameters added after it;
7. the offload of saved activations;
8. the replaced parameters remembered, so a stale optimizer is refused.

How each step is done lives in its own module (parallelize.py, tiling.py, checkpoint_levels.py,
pinned.py, guards.py); accelerate, which applies FSDP itself, runs steps 1-5 (`before_fsdp`) and
7 (`after_fsdp`) around its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn

from cpctl import upstream
from cpctl.config import Profile
from cpctl.errors import CpctlError
from cpctl.runtime import adapters, guards, loading
from cpctl.runtime.checkpoint_levels import BlockLevels
from cpctl.runtime.context import StepContext
from cpctl.runtime.mesh import Axis
from cpctl.runtime.parallelize import apply_activation_checkpointing, apply_fsdp, apply_tensor_parallel, find_blocks
from cpctl.runtime.pinned import HostArena, offload_saved_activations
from cpctl.runtime.tiling import apply_tiled_mlp, apply_tiled_norms


class ModelPreparation:
    """The preparation of this runtime's models, and what it keeps for their steps (checkpoint
    levels, the host memory of offloaded activations)."""

    def __init__(self, context: StepContext) -> None:
        self.context = context
        self.levels: BlockLevels | None = None  # which checkpointed blocks are selective (memory.checkpoint_level)
        self._host_arena: HostArena | None = None

    @property
    def config(self) -> Profile:
        return self.context.config

    def prepare(self, model: nn.Module, *, tp_plan: dict | None = None,
                blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """The whole pipeline (`rt.prepare_model`)."""
        before = {id(p): p for p in model.parameters()}
        checkpointing = self._adopt(model)
        device = self.context.device
        if loading.has_meta_parameters(model):  # rt.from_pretrained's: given memory once sharded
            loading.move_buffers(model, device)
        else:
            model = model.to(device)
        tp_mesh = self.context.mesh.present(Axis.TP)
        if tp_mesh is not None:
            apply_tensor_parallel(model, tp_mesh=tp_mesh, tp_plan=tp_plan)
        found = self._transform_blocks(model, list(blocks) if blocks is not None else None, checkpointing=checkpointing)
        self._shard(model, found)
        self.after_fsdp(model)
        guards.forget_replaced_parameters(before, model)
        return model

    def before_fsdp(self, model: nn.Module) -> nn.Module:
        """Steps 1-5, for a framework that applies FSDP itself (accelerate)."""
        self._transform_blocks(model, None, checkpointing=self._adopt(model))
        return model

    def after_fsdp(self, model: nn.Module) -> nn.Module:
        """Step 7: the offload of saved activations."""
        if self.config.memory.offload_activations:
            offload_saved_activations(model, arena=self.host_arena)
        return model

    @property
    def host_arena(self) -> HostArena | None:
        """Where offloaded activations wait for backward (with memory.offload_activations)."""
        if self._host_arena is None and self.config.memory.offload_activations:
            self._host_arena = HostArena(self.context.device)
        return self._host_arena

    @property
    def selective_blocks(self) -> int | None:
        """How many checkpointed blocks (the last ones) keep attention's tensors, as of the last step."""
        return None if self.levels is None else self.levels.count

    # ------------------------------------------------------------------ the steps

    def _adopt(self, model: nn.Module) -> bool:
        """Steps 1-2: the refusals, then the model's adapter; whether the model is to be checkpointed."""
        if upstream.uncompiled(model) is not model:
            # its compiled graph would keep the attention it was traced with, and FSDP2 would wrap the wrapper
            raise CpctlError("the model was compiled (torch.compile) before rt.prepare_model: prepare the model "
                             "itself, then compile what prepare_model returns (model = torch.compile(rt.prepare_model(model)))")
        guards.refuse_sharded(model)
        guards.refuse_quantized(model)
        checkpointing = self.config.fsdp.activation_checkpointing
        found = adapters.adapter_for(model)  # the model itself, or the one a wrapper (PEFT) holds
        if found is not None:
            adapter, inner = found
            # Its own gradient checkpointing would recompute outside CP's routing: ours instead.
            checkpointing = adapter.prepare(inner, self.context) or checkpointing
        return checkpointing

    def _transform_blocks(self, model: nn.Module, blocks: list[nn.Module] | None, *, checkpointing: bool) -> list[nn.Module]:
        """Step 5: tiled MLPs and norms, and checkpointing per block; the blocks FSDP then shards
        (wrapped ones, if found here)."""
        found = blocks if blocks is not None else find_blocks(model)
        memory = self.config.memory
        if memory.tiled_mlp_tokens:  # before checkpointing wraps the blocks
            apply_tiled_mlp(found, tile_tokens=memory.tiled_mlp_tokens)
        if memory.tiled_norm_tokens:
            apply_tiled_norms(found, tile_tokens=memory.tiled_norm_tokens, model=model)
        if checkpointing:
            # each model's blocks read their own model's levels (self.levels reports the latest's count)
            levels = self.levels = BlockLevels(self.config, blocks=len(found), model=model, device=self.context.device)
            wrappers = apply_activation_checkpointing(found, model,
                                                      contexts=functools.partial(self._block_contexts, levels=levels))
            if levels.choosing and wrappers:  # before its level is asked for: the step's shape
                wrappers[0].register_forward_pre_hook(functools.partial(self._observe_first_block, levels=levels),
                                                      with_kwargs=True)
            found = find_blocks(model) if blocks is None else found
        return found

    def _block_contexts(self, index: int, *, levels: BlockLevels):
        """Called at each call of checkpointed block `index` of the model `levels` belongs to: the contexts
        around its forward and its recompute."""
        return self.context.block_contexts(selective=levels.selective(index), arena=self.host_arena)

    @staticmethod
    def _observe_first_block(module: nn.Module, args: tuple, kwargs: dict, *, levels: BlockLevels) -> None:
        levels.observe(args[0] if args else kwargs.get("hidden_states"))

    def _shard(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Step 6: FSDP2, or, without it, a refusal where ranks would drift apart."""
        if self.config.fsdp.version == 2:
            apply_fsdp(model, mesh=self.context.mesh.axes[Axis.FSDP], fsdp=self.config.fsdp, blocks=blocks,
                       cpu_offload=self.config.memory.cpu_offload)
            guards.refuse_parameters_added_later(model)
        elif self.context.mesh.dp_cp_enabled:
            # Without a gradient reduction the ranks would drift apart, and token_mean's scaling
            # (which expects the average over dp x cp ranks) would be wrong.
            raise CpctlError(
                "fsdp.version: 1 with several data-parallel ranks; cpctl's prepare_model applies FSDP2 only: "
                "set fsdp.version: 2 (or wrap the model in DDP/FSDP yourself and skip prepare_model)"
            )
