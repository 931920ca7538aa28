"""`model.save_pretrained(...)` of a model FSDP2 shards (accelerate's `prepare` on cpctl's route).

transformers gathers sharded weights for saving only for models it sharded itself (its
`distributed_config`); a model accelerate's FSDP2 prepared holds DTensor shards, which
safetensors cannot write. Every rank calls `save_pretrained` (as accelerate's examples do): here
they gather the full state dict together (torch.distributed.checkpoint's `get_model_state_dict`,
to CPU, on rank 0), and rank 0 writes what one process would have written.
"""

from __future__ import annotations

import functools
from typing import Any

from cpctl.integrations.patches import PATCHES

CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"  # what activation checkpointing adds to parameter names


def install() -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import PreTrainedModel

    PATCHES.replace(PreTrainedModel, "save_pretrained", _gathering,
                    why="an FSDP2-sharded model saves its full weights from rank 0")


def _gathering(save_pretrained: Any) -> Any:
    @functools.wraps(save_pretrained)
    def save_full(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is not None or not _is_fsdp2(self):
            return save_pretrained(self, save_directory, *args, **kwargs)
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full = {name.replace(CHECKPOINT_WRAPPER, ""): tensor for name, tensor in full.items()}
        main = dist.get_rank() == 0
        kwargs.update(state_dict=full if main else {}, is_main_process=main and kwargs.get("is_main_process", True))
        result = save_pretrained(self, save_directory, *args, **kwargs) if main else None
        dist.barrier()  # the files exist for every rank once it returns
        return result

    return save_full


def _is_fsdp2(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.6 keeps FSDP2 here
        from torch.distributed._composable.fsdp import FSDPModule
    return isinstance(model, FSDPModule)
