"""`from_pretrained` in an accelerate script or a Trainer: the weights read once per job, not per rank.

Such scripts call `from_pretrained` on every rank, and each rank held the whole model until
accelerate's FSDP2 preparation sharded it (with fp32 master weights, one fp32 copy per rank).
Under `cpctl launch` with several ranks, rank 0 alone reads the checkpoint; every other rank
builds the model with empty parameters (`torch.empty`: memory the OS has not handed out until it
is written) and its buffers computed as usual, and accelerate's FSDP2 preparation sends each rank
its shards from rank 0 (its `cpu_ram_efficient_loading` path, switched on for these models
whatever the Trainer's arguments set): one copy per job.

Only a plain load takes this path: a local directory of safetensors files and keyword arguments
that building from the config honours alike (`attn_implementation`, `dtype`, `config`, overrides
of config attributes such as `use_cache`; `None` and `{}` count as absent); anything else (a
quantization config, a device map, a Hub name, a PEFT adapter) loads as transformers does, on
every rank.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path
from typing import Any

from torch import nn

from cpctl.errors import CpctlError
from cpctl.integrations.patches import PATCHES
from cpctl.runtime import loading
from cpctl.runtime.runtime import Runtime

_sent_from_rank0: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose weights rank 0 sends
# This rank's models with placeholder parameters, and the hook that refuses to run them until filled.
_empty: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def install(runtime: Runtime) -> None:
    """On the accelerate route with several ranks and FSDP2 (cpctl.integrations.accelerate_shim)."""
    from transformers import PreTrainedModel

    if runtime.world_size == 1 or runtime.config.fsdp.version != 2:
        return
    original = PreTrainedModel.__dict__["from_pretrained"].__func__
    PATCHES.replace(PreTrainedModel, "from_pretrained", lambda _: classmethod(_reading_once(original, runtime)),
                    why="a checkpoint is read by rank 0 only; accelerate's FSDP2 preparation sends the shards")


def _reading_once(from_pretrained: Any, runtime: Runtime) -> Any:
    @functools.wraps(from_pretrained)
    def read_once(cls, pretrained_model_name_or_path, *args, **kwargs):
        path = Path(str(pretrained_model_name_or_path))
        given = loading.present(kwargs)
        local = path.is_dir() and any(path.glob("*.safetensors")) and not (path / "adapter_config.json").exists()
        if not local or args or loading.config_with(given, path) is None:
            return from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        if runtime.rank == 0:
            model = from_pretrained(cls, pretrained_model_name_or_path, **kwargs)
            _check_tied_as_configured(model, cls, path, given)
        else:
            model, _ = loading.build_on_meta(cls, path, **given)
            loading.materialize(model, device="cpu")  # empty: the pages are touched only by what rank 0 sends
            model.eval()  # as from_pretrained returns it
            _empty[model] = model.register_forward_pre_hook(_refuse_before_prepare)
        _sent_from_rank0.add(model)
        return model

    return read_once


def _check_tied_as_configured(model: nn.Module, cls: Any, path: Path, given: dict[str, Any]) -> None:
    """The other ranks build the model from its config, ties included, and accelerate ties it again
    before sending the weights; transformers leaves a tie undone where the checkpoint holds both
    copies with different values. Such a model is not its config's: one line, on rank 0."""
    configured, _ = loading.build_on_meta(cls, path, **given)
    loaded = loading.tied_names(model)
    for names in loading.tied_names(configured):
        if not any(names <= group for group in loaded):
            first, other = sorted(names)[:2]
            raise CpctlError(loading.untied_message(f"{cls.__name__}.from_pretrained({str(path)!r})", first, other))


def sends_from_rank0(model: nn.Module) -> bool:
    """Whether accelerate's FSDP2 preparation must send `model`'s weights from rank 0."""
    return _loaded(model) in _sent_from_rank0


def has_placeholders(model: nn.Module) -> bool:
    """Whether this rank's parameters of `model` are placeholders whose values do not matter yet."""
    return _loaded(model) in _empty


def filled(model: nn.Module) -> None:
    """accelerate's preparation has sent `model` its weights from rank 0: it may run."""
    hook = _empty.pop(_loaded(model), None)
    if hook is not None:
        hook.remove()


def _loaded(model: nn.Module) -> nn.Module:
    """The model from_pretrained returned: `model`, or the one it wraps (TRL's and the Trainer's
    get_peft_model put a PEFT model around it before preparing; rank 0's adapters go out with
    the base's weights)."""
    from cpctl.integrations.huggingface import huggingface_model_in

    if model in _sent_from_rank0:
        return model
    return huggingface_model_in(model) or model


def _refuse_before_prepare(module: nn.Module, args: tuple) -> None:
    raise CpctlError(f"{type(module).__name__} was loaded with from_pretrained, which under cpctl launch reads a "
                     "checkpoint on rank 0 only: this rank holds no weights until accelerator.prepare (or the "
                     "Trainer) sends them; pass the model to accelerator.prepare before calling it")
