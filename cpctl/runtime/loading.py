"""Pretrained weights into a sharded model without a full copy per rank (`rt.from_pretrained`).

`from_pretrained` on every rank builds the whole model on every rank's host before FSDP2 shards
it: N ranks of a machine, N copies (8 x 32 GB for an 8B model in fp32). Here every rank builds
the model with its parameters on the meta device (no memory; buffers such as RoPE's inverse
frequencies are computed as usual, they are not in checkpoints), cpctl prepares it as any other
(TP, checkpointing, FSDP2 shard the meta parameters), the parameters become empty tensors on
the device, and torch.distributed.checkpoint's Hugging Face reader fills each rank's shards
with the slices of the safetensors files that rank holds. A weight the model has and the
checkpoint lacks (other than a tied copy), or one the checkpoint has and the model lacks, is an
error: transformers would initialise or drop it with a warning.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cpctl.errors import CpctlError


def build_on_meta(model_class: Any, path: str | os.PathLike, **kwargs: Any) -> tuple[nn.Module, list[set[str]]]:
    """The model of the checkpoint at `path` with meta parameters, and its groups of tied names."""
    from transformers import AutoConfig

    directory = Path(path)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise CpctlError(f"rt.from_pretrained({str(path)!r}): not a local directory with .safetensors files; "
                         "download the checkpoint first (e.g. `hf download NAME --local-dir DIR`), or convert "
                         "pickled weights with save_pretrained")
    config_keys = {"trust_remote_code", "revision"}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(
        directory, **{k: v for k, v in kwargs.items() if k in config_keys})
    if kwargs.get("dtype", kwargs.get("torch_dtype")) == "auto":  # the checkpoint's: the config's own
        kwargs = {k: v for k, v in kwargs.items() if k not in ("dtype", "torch_dtype")}
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    with parameters_on_meta():
        model = build(config, **{k: v for k, v in kwargs.items() if k not in config_keys})
    return model, tied_names(model)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is replaced by a meta one as it is assigned, before its
    module initialises it (so the initialisation costs nothing); buffers stay real."""
    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.device.type == "meta":
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def tied_names(model: nn.Module) -> list[set[str]]:
    """Names that share one parameter (an embedding tied to the head): a checkpoint stores one of each."""
    by_param: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), set()).add(name)
    return [names for names in by_param.values() if len(names) > 1]


def has_meta_parameters(model: nn.Module) -> bool:
    return any(param.device.type == "meta" for param in model.parameters())


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)` for a model whose parameters are still meta: its buffers only."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def load_weights(model: nn.Module, path: str | os.PathLike, *, device: torch.device, tied: list[set[str]]) -> None:
    """Give a prepared model's meta parameters memory on `device` and fill this rank's shards from
    the safetensors files at `path`. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        raise CpctlError(f"rt.from_pretrained reads safetensors through torch.distributed.checkpoint's "
                         f"HuggingFaceStorageReader, which torch {torch.__version__} lacks: install torch>=2.9, "
                         "or load with from_pretrained and rt.prepare_model") from None
    buffers = materialize(model, device=device)
    reader = HuggingFaceStorageReader(str(path))
    stored = set(reader.read_metadata().state_dict_metadata)
    state = get_model_state_dict(model)
    _check_names(set(state), stored, tied=tied, buffers=buffers, path=path)
    state = {name: tensor for name, tensor in state.items() if name in stored}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def materialize(model: nn.Module, *, device: torch.device | str) -> set[str]:
    """Meta parameters become empty tensors on `device` (values to be written by a load); buffers
    keep their values and tied parameters stay tied. Returns the buffers' names."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():  # to_empty left the buffers uninitialised too
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if hasattr(model, "tie_weights"):  # to_empty gives each name its own tensor
        model.tie_weights()
    return set(buffers)


def _check_names(wanted: set[str], stored: set[str], *, tied: list[set[str]], buffers: set[str], path: Any) -> None:
    stored_or_tied = set(stored)
    for names in tied:
        if names & stored:
            stored_or_tied |= names
    missing = sorted(name for name in wanted - stored_or_tied if name not in buffers)
    extra = sorted(stored - wanted - buffers)
    if missing or extra:
        said = [f"{len(missing)} weights of the model are not in it ({', '.join(missing[:3])})" if missing else "",
                f"it has {len(extra)} weights the model lacks ({', '.join(extra[:3])})" if extra else ""]
        raise CpctlError(f"rt.from_pretrained({str(path)!r}): the checkpoint does not fit the model: "
                         f"{'; '.join(filter(None, said))}; is it a checkpoint of this architecture?")
