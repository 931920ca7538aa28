"""Misuse the runtime cannot make right, caught where it is cheap: bad buffer arguments, CP
ranks fed different inputs, an optimizer holding the parameters prepare_model replaced, a
quantized model."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cpctl.errors import CpctlError


def check_buffers(buffers: list, seq_dims: list, no_restore: list) -> None:
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
                             f"a tensor of shape {tuple(t.shape)} is not among the buffers: add it to buffers "
                             "(labels are sharded like the tokens) or leave it out of no_restore_buffers")
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



_FINGERPRINT_ROWS, _FINGERPRINT_SAMPLE = 16, 65536
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprints(buffers: list[torch.Tensor]) -> torch.Tensor:
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


def forget_replaced_parameters(before: dict[int, torch.Tensor], model: nn.Module) -> None:
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


def refuse_parameters_added_later(model: nn.Module) -> None:
    """Parameters that appear after FSDP2 sharded `model` (get_peft_model after prepare_model, a
    module attached later) are neither sharded nor reduced: each rank would train its own copy on
    its own shard of the sequence. Refused at the next forward, on every rank alike."""
    known = {(id(module), name) for module in model.modules() for name in module._parameters}

    def check(module: nn.Module, args: tuple) -> None:
        added = [f"{path}.{name}" if path else name for path, sub in module.named_modules()
                 for name, param in sub._parameters.items() if param is not None and (id(sub), name) not in known]
        if added:
            raise CpctlError(f"{len(added)} parameters were added to the model after rt.prepare_model "
                             f"({', '.join(added[:2])}{', ...' if len(added) > 2 else ''}): FSDP2 neither shards "
                             "nor reduces them; add them before prepare_model (get_peft_model(model, config), then "
                             "rt.prepare_model)")

    model.register_forward_pre_hook(check, prepend=True)


# Weights stored in these dtypes are quantized: no kernel trains through them as they are, and
# FSDP2 would shard the packed bytes, not the values.
_QUANTIZED_DTYPES = {getattr(torch, name) for name in ("int8", "uint8", "int4", "float8_e4m3fn", "float8_e5m2",
                                                        "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2")
                     if hasattr(torch, name)}


def refuse_sharded(model: nn.Module) -> None:
    """A model whose parameters are already distributed (FSDP2's `fully_shard`, or tensor parallel
    DTensors: `rt.prepare_model` called on it before, or the script's own sharding) is one line:
    sharding it again fails deep in torch, naming neither the model nor the fix."""
    from torch.distributed.tensor import DTensor

    name = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if name is not None:
        raise CpctlError(f"the model is already sharded ({name} is a DTensor): rt.prepare_model prepares a model "
                         "once; call it on the model as built or loaded, and use the model it returns from then on")


def refuse_quantized(model: nn.Module) -> None:
    """A quantized model (bitsandbytes' 4/8-bit, GPTQ/AWQ, torchao or torch's own quantized
    modules, weights in int8 or float8) is one line before any sharding: cpctl shards and trains
    weights in fp32, bf16 or fp16 only."""
    quantizer = getattr(model, "hf_quantizer", None) or (
        getattr(model, "get_base_model", None) and getattr(model.get_base_model(), "hf_quantizer", None))
    what = None
    if quantizer is not None or getattr(model, "is_quantized", False):
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
        what = f"it was loaded quantized ({getattr(method, 'value', method) or 'a quantization_config'})"
    else:
        for name, module in model.named_modules():
            origin = type(module).__module__
            if origin.startswith(("bitsandbytes", "torch.ao.nn.quantized", "torchao", "auto_gptq", "awq")):
                what = f"{name or 'the model'} is a quantized module ({origin}.{type(module).__name__})"
                break
            low = next(((n, p) for n, p in module.named_parameters(recurse=False) if p.dtype in _QUANTIZED_DTYPES), None)
            if low is not None:
                what = f"{name}.{low[0]} is stored in {str(low[1].dtype).removeprefix('torch.')}"
                break
    if what is not None:
        raise CpctlError(f"a quantized model cannot be prepared by cpctl: {what}. cpctl shards and computes weights "
                         "in fp32, bf16 or fp16: load the base in bf16 (dtype=torch.bfloat16) and train LoRA adapters "
                         "on it")
