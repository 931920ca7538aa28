"""Turning a plain model into a parallel one: tensor parallelism, activation checkpointing, FSDP2.

The steps themselves; their order (torchtitan's: TP first, as it rewrites Linear weights into
DTensors on the tp axis, then checkpointing around each block, then FSDP2 `fully_shard` on
every block and finally the root) is runtime/preparation.py's. FSDP shards over the
(dp_replicate,) dp_shard*cp axes: CP ranks hold different tokens of the same sequences, so for
FSDP they are data-parallel ranks, and parameters are sharded over them too. Trainable parameters are sharded as fp32 master
weights whatever dtype they arrive in (fsdp.master_weights); compute runs in mixed_precision's.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpctl.config import Fsdp
from cpctl.errors import CpctlError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # the dtypes master weights are not kept in
_log = logging.getLogger("cpctl")
# (master_weights, dtypes) already said at INFO in this process: a log's once-registry, as warnings keeps one
_told: set[tuple[str, str]] = set()


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the children of the largest nn.ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def apply_tensor_parallel(model: nn.Module, *, tp_mesh: DeviceMesh, tp_plan: dict | None) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan if tp_plan is not None else huggingface_tp_plan(model)
    if not plan:
        raise CpctlError(
            f"tp_size is {tp_mesh.size()} but the model has no tensor-parallel plan; pass "
            "rt.prepare_model(model, tp_plan={'layers.*.attn.q_proj': ColwiseParallel(), ...}) or set tp_size: 1"
        )
    parallelize_module(model, tp_mesh, plan)


def huggingface_tp_plan(model: nn.Module) -> dict | None:
    """A Hugging Face model's own `config.base_model_tp_plan`, as ParallelStyle objects.

    Its keys are relative to the base model (`model.model` of a `...ForCausalLM`) and its
    styles are names; the two that plain transformer blocks use are translated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    translated = {}
    for key, style in plan.items():
        if not isinstance(style, str):
            translated[prefix + key] = style
        elif style in styles:
            translated[prefix + key] = styles[style]()
        else:
            raise CpctlError(f"the model's base_model_tp_plan uses style {style!r} for {key}, which cpctl does not "
                             "translate; pass rt.prepare_model(model, tp_plan={...}) with ParallelStyle objects")
    return translated


def apply_activation_checkpointing(blocks: list[nn.Module], model: nn.Module, *,
                                   contexts: Callable[[int], tuple[AbstractContextManager, AbstractContextManager]]
                                   ) -> list[nn.Module]:
    """Wrap each block so its activations are recomputed in backward; returns the wrappers, in
    the order of `blocks`.

    `contexts(index)` is called at each call of block `index` (its place in `blocks`) and gives
    the contexts entered around its forward and around its recompute: the recompute runs inside
    backward, where the forward's SDPA routing is no longer active, and must compute attention
    the same way (across the CP group) again, or (selective level) reuse what the forward's
    attention returned.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    # Find every (parent, name) first: wrapping while walking the tree would find each
    # block again inside its own wrapper.
    index = {id(block): position for position, block in enumerate(blocks)}
    slots = [(parent, name, index[id(child)]) for parent in model.modules() for name, child in parent.named_children()
             if id(child) in index]
    wrappers: dict[int, nn.Module] = {}
    for parent, name, position in slots:
        # The recompute replays the forward's RNG: dropout (LoRA's lora_dropout, a model's hidden
        # dropout) must draw the same masks, or the gradients are of another forward.
        wrappers[position] = checkpoint_wrapper(getattr(parent, name), preserve_rng_state=True,
                                                context_fn=functools.partial(contexts, position))
        parent.register_module(name, wrappers[position])
    return [wrappers[position] for position in sorted(wrappers)]


def low_precision_trainable(model: nn.Module) -> Counter[str]:
    """The trainable parameters of `model` in bf16 or fp16, counted by dtype (tied ones once)."""
    return Counter(_LOW[p.dtype] for p in model.parameters() if p.requires_grad and p.dtype in _LOW)


def upcast_trainable(module: nn.Module, *, placeholders: bool = False) -> None:
    """Trainable bf16/fp16 parameters become fp32 in place (the same Parameter objects, so an
    optimizer built on them still holds them, as accelerate's `fsdp2_prepare_model` does it);
    frozen parameters (a LoRA base) and buffers keep their dtype. `placeholders`: the values are
    to be overwritten (rank 0 sends them), so fp32 memory is reserved, not written."""
    for param in module.parameters():
        if param.requires_grad and param.dtype in _LOW:
            param.data = (torch.empty_like(param.data, dtype=torch.float32) if placeholders
                          else param.data.to(torch.float32))


def tell_master_weights(found: Counter[str], *, master_weights: str, main: bool) -> None:
    """One line on rank 0 for what `low_precision_trainable` found: INFO the first time in the
    process, DEBUG for the next models."""
    if not found or not main:
        return
    dtypes = "/".join(sorted(found))
    count = sum(found.values())
    if master_weights == "keep":
        message = (f"{count} trainable parameters arrived in {dtypes} and are trained in {dtypes} "
                   "(fsdp.master_weights: keep): gradients and AdamW's state are " + dtypes)
    else:
        message = (f"{count} trainable parameters arrived in {dtypes}; kept as fp32 master weights, with fp32 "
                   f"gradients and AdamW state (fsdp.master_weights: keep trains them in {dtypes})")
    first = (master_weights, dtypes) not in _told
    _told.add((master_weights, dtypes))
    _log.log(logging.INFO if first else logging.DEBUG, message)


def master_weights_for_fsdp(model: nn.Module, *, master_weights: str, main: bool, placeholders: bool = False) -> None:
    """What accelerate's FSDP2 preparation is to find (the accelerate route): trainable
    low-precision parameters as fp32, unless the profile keeps them; said once."""
    found = low_precision_trainable(model)
    if master_weights == "fp32":
        upcast_trainable(model, placeholders=placeholders)
    tell_master_weights(found, master_weights=master_weights, main=main)


def fsdp2() -> ModuleType:
    """torch's FSDP2 (fully_shard, FSDPModule, its policies): torch.distributed.fsdp, or the module
    torch 2.6 (cpctl's oldest, versions.MIN_TORCH) keeps it in."""
    from torch.distributed import fsdp

    if hasattr(fsdp, "fully_shard"):
        return fsdp
    from torch.distributed._composable import fsdp as composable

    return composable


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, fsdp: Fsdp, blocks: list[nn.Module],
               cpu_offload: bool = False) -> None:
    """FSDP2 on each block, then the root. Trainable low-precision parameters are upcast to fp32
    master weights first (fsdp.master_weights), block by block just before each is sharded, so
    the whole model is never held in fp32 unsharded; compute runs in mixed_precision's dtype."""
    api = fsdp2()
    param_dtype = _DTYPES.get(fsdp.mixed_precision)
    policy = (api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype
              else api.MixedPrecisionPolicy())
    # PyTorch's own offload: sharded parameters, gradients and optimizer state live in pinned CPU memory.
    offload = api.CPUOffloadPolicy() if cpu_offload else api.OffloadPolicy()
    found = low_precision_trainable(model)
    upcast = fsdp.master_weights == "fp32"
    for block in blocks:
        if upcast:
            upcast_trainable(block)
        api.fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload,
                        reshard_after_forward=fsdp.reshard_after_forward)
    if upcast:
        upcast_trainable(model)  # the root's own: embeddings, head, final norm (the blocks' are done)
    # The root's parameters (embeddings, head) are used last in backward: keep them gathered.
    api.fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    tell_master_weights(found, master_weights=fsdp.master_weights, main=mesh.get_rank() == 0)
