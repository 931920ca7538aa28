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


# from_pretrained's arguments that building from the config takes as from_pretrained does
BUILD_ARGUMENTS = ("attn_implementation", "dtype", "torch_dtype")
# ... that choose the config (read by AutoConfig), and that change nothing for a local directory
# (the hub's, the Auto classes' own mark, an adapter's hub arguments that a directory without one ignores)
CONFIG_ARGUMENTS = ("trust_remote_code", "revision")
IGNORED_ARGUMENTS = ("low_cpu_mem_usage", "use_safetensors", "_from_auto", "cache_dir", "local_files_only",
                     "force_download", "proxies", "token", "adapter_kwargs")


def build_on_meta(model_class: Any, path: str | os.PathLike, **kwargs: Any) -> tuple[nn.Module, list[set[str]]]:
    """The model of the checkpoint at `path` with meta parameters, and its groups of tied names;
    `kwargs` as from_pretrained takes them (a config attribute's override among them)."""
    directory = Path(path)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise CpctlError(f"rt.from_pretrained({str(path)!r}): not a local directory with .safetensors files; "
                         "download the checkpoint first (e.g. `hf download NAME --local-dir DIR`), or convert "
                         "pickled weights with save_pretrained")
    kwargs = present(kwargs)
    config = config_with(kwargs, directory)
    if config is None:
        unknown = sorted(set(kwargs) - {*BUILD_ARGUMENTS, *CONFIG_ARGUMENTS, *IGNORED_ARGUMENTS, "config"})
        raise CpctlError(f"rt.from_pretrained({str(path)!r}): {', '.join(unknown)} is neither an argument it takes "
                         f"({', '.join(BUILD_ARGUMENTS)}, config, ...) nor an attribute of the model's config; load with "
                         "from_pretrained on every rank, then rt.prepare_model")
    build_kwargs = {k: v for k, v in kwargs.items() if k in BUILD_ARGUMENTS}
    if build_kwargs.get("dtype", build_kwargs.get("torch_dtype")) == "auto":  # the checkpoint's: the config's own
        build_kwargs = {k: v for k, v in build_kwargs.items() if k not in ("dtype", "torch_dtype")}
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    with parameters_on_meta():
        model = build(config, **build_kwargs)
    return model, tied_names(model)


def present(kwargs: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained's arguments without those given as None or {}, which mean absent (TRL passes
    device_map=None, the Auto classes adapter_kwargs={})."""
    return {k: v for k, v in kwargs.items() if v is not None and not (isinstance(v, dict) and not v)}


def config_with(given: dict[str, Any], path: Path) -> Any:
    """The config from_pretrained(path, **given) builds: `config=` or the directory's, with the
    overrides of config attributes among `given` (e.g. use_cache=False); None where an argument is
    none of these."""
    import copy

    from transformers import AutoConfig

    overrides = {k: v for k, v in given.items()
                 if k not in (*BUILD_ARGUMENTS, *CONFIG_ARGUMENTS, *IGNORED_ARGUMENTS, "config")}
    config = given.get("config") or AutoConfig.from_pretrained(
        path, **{k: v for k, v in given.items() if k in CONFIG_ARGUMENTS})
    if any(not hasattr(config, name) for name in overrides):
        return None
    if overrides:
        config = copy.deepcopy(config)
        for name, value in overrides.items():
            setattr(config, name, value)
    return config


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


def built_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Each parameter's dtype as built (from_pretrained's `dtype`, or the config's), before
    preparation may keep it as fp32 master weights: what load_weights rounds the checkpoint to."""
    return {name: param.dtype for name, param in model.named_parameters(remove_duplicate=False)}


def has_meta_parameters(model: nn.Module) -> bool:
    return any(param.device.type == "meta" for param in model.parameters())


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)` for a model whose parameters are still meta: its buffers only."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def load_weights(model: nn.Module, path: str | os.PathLike, *, device: torch.device, tied: list[set[str]],
                 dtypes: dict[str, torch.dtype]) -> None:
    """Give a prepared model's meta parameters memory on `device` and fill this rank's shards from
    the safetensors files at `path`, each value rounded to the dtype its weight was built in
    (`dtypes`, built_dtypes) as from_pretrained rounds it, even where preparation keeps the
    weight wider (fp32 master weights of a model asked for in bf16). Collective: every rank calls it."""
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
    copies = _stored_copies(state, tied)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    _check_copies_equal(state, copies, device=device, path=path)
    _round_to_built(state, dtypes)
    for names in copies.values():
        for name in names:
            del state[name]
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _round_to_built(state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> None:
    """Each loaded value held wider than its weight was built in, rounded to that dtype in place
    (this rank's shard of it)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, tensor in state.items():
            built = dtypes.get(name)
            if (built is not None and built.is_floating_point and tensor.is_floating_point()
                    and torch.finfo(built).bits < torch.finfo(tensor.dtype).bits):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.copy_(local.to(built))


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


def _stored_copies(state: dict[str, torch.Tensor], tied: list[set[str]]) -> dict[str, list[str]]:
    """A tied group's names that the checkpoint stores more than once: each copy after the first
    gets its own tensor in `state` (read, compared, then dropped). {first name: other names}."""
    copies = {}
    for names in tied:
        held = sorted(name for name in names if name in state)
        if len(held) > 1:
            copies[held[0]] = held[1:]
            for name in held[1:]:
                state[name] = torch.empty_like(state[held[0]])
    return copies


def _check_copies_equal(state: dict[str, torch.Tensor], copies: dict[str, list[str]], *,
                        device: torch.device, path: Any) -> None:
    """transformers ties a group the checkpoint stores twice only where the copies are equal (a
    checkpoint saved with torch.save holds both); different copies mean a config that ties what the
    checkpoint does not, and one tensor would silently get the last copy read. Each rank compares
    its shards; `device` is where the process group's backend takes the verdict."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not copies:
        return

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    differ = [(first, other) for first, others in copies.items() for other in others
              if not torch.equal(local(state[first]), local(state[other]))]
    anywhere = torch.tensor([len(differ)], device=device)
    if dist.is_initialized():
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if anywhere.item():
        first, other = differ[0] if differ else next((f, o[0]) for f, o in copies.items())
        raise CpctlError(untied_message(f"rt.from_pretrained({str(path)!r})", first, other))


def untied_message(call: str, first: str, other: str) -> str:
    return (f"{call}: the model's config ties {first} to {other}, but the checkpoint holds both with different "
            "values (transformers would leave them untied, a model other than the config's); load it with "
            "the config the checkpoint was saved with (e.g. tie_word_embeddings=False)")


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
