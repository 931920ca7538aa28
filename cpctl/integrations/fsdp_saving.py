"""A sharded model saved in Hugging Face's format, from every route: the files transformers writes.

transformers gathers sharded weights only for models it sharded itself, and safetensors cannot
write DTensor shards; the Trainer under FSDP writes no model at all unless told
FULL_STATE_DICT. Here, for a model whose parameters are DTensors (cpctl's `prepare_model`,
accelerate's FSDP2 on cpctl's route, the Trainer and TRL, which prepare through accelerate):

* `PreTrainedModel.save_pretrained(dir)`, called on every rank as accelerate's examples do:
  the full weights are gathered, and rank 0 writes what one process would have written,
  safetensors sharded with an index past `max_shard_size`; given whole weights the caller
  gathered (`state_dict=accelerator.get_state_dict(model)`), rank 0 writes them alone, so the
  call may also be under `if accelerator.is_main_process:`;
* `Accelerator.get_state_dict(model)` gathers the full weights to rank 0 (as accelerate's own
  FSDP2 branch means to) and `Accelerator.save_model(model, dir)` writes them once;
* `peft.PeftModel.save_pretrained(dir)`: only the tensors peft saves (the adapters, any bias)
  are gathered, the frozen base stays sharded; rank 0 writes the adapter files;
* `Trainer.save_model(dir)` (and so its periodic checkpoints and TRL's trainers): the same
  full weights whatever `FSDP_STATE_DICT_TYPE` says, with the Trainer's own extra files
  (tokenizer, training arguments); the Trainer's sharded resume files are still written beside,
  under the names of the model without cpctl's checkpoint wrappers (a LoRA run's adapters too:
  peft matches them by those names), and read back the same way.

Every write goes through cpctl.runtime.saving: all ranks together, into a staging directory
moved in only when complete, one error line on every rank when it cannot be done.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

from cpctl.integrations.patches import PATCHES
from cpctl.runtime import saving
from cpctl.upstream import Shape

# Inside rank 0's write: the nested save_pretrained (the Trainer's `_save` calls it) writes as is.
_writing: contextvars.ContextVar[bool] = contextvars.ContextVar("cpctl_writing", default=False)
# Inside rank 0's write of Accelerator.save_model: the weights it gathered, for its own get_state_dict call.
_gathered: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cpctl_gathered", default=None)
# accelerate's functions the Trainer writes and reads its sharded resume files with (FSDP)
RESUME_FILES = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")


def install() -> None:
    """Patch transformers' saving (once per process; a no-op without transformers)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import PreTrainedModel, Trainer

    if not PATCHES.is_patched(PreTrainedModel, "save_pretrained"):
        PATCHES.replace(PreTrainedModel, "save_pretrained", _gathering,
                        why="a sharded model saves its full weights, written once by rank 0, never half")
    if "peft" in sys.modules and not PATCHES.is_patched(sys.modules["peft"].PeftModel, "save_pretrained"):
        PATCHES.replace(sys.modules["peft"].PeftModel, "save_pretrained", _gathering_adapters,
                        why="a sharded PEFT model saves its adapters, gathered and written once by rank 0")
    if not PATCHES.is_patched(Trainer, "save_model"):
        PATCHES.replace(Trainer, "save_model", _saving_full_weights,
                        why="the Trainer under FSDP saves the full model in Hugging Face's format, whatever "
                            "FSDP_STATE_DICT_TYPE says")
    trainer_module = sys.modules[Trainer.__module__]
    for name in RESUME_FILES:
        if hasattr(trainer_module, name) and not PATCHES.is_patched(trainer_module, name):
            PATCHES.replace(trainer_module, name, _under_unwrapped_names,
                            why="the Trainer's sharded resume files name what the model without cpctl's "
                                "checkpoint wrappers has (peft's adapter-only save matches those names)",
                            needs=Shape(parameters=("model",)))



def _under_unwrapped_names(function: Any) -> Any:
    """`function(..., model=...)` with the model's activation-checkpointing wrappers lifted: its
    state's names are then the unwrapped model's, the same whether checkpointing is on or not.
    Through the wrappers, peft's adapter-only state (a LoRA run's checkpoint) matched no name:
    the Trainer saved no weights and resumed from none, silently."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def lifted(*args, **kwargs):
        model = signature.bind(*args, **kwargs).arguments["model"]
        with saving.checkpoint_wrappers_lifted(model):
            return function(*args, **kwargs)

    return lifted


def install_accelerate() -> None:
    """Patch accelerate's saving as well (an accelerate script's worker, the Trainer's and TRL's)."""
    from accelerate import Accelerator

    install()
    PATCHES.replace(Accelerator, "get_state_dict", _full_on_rank0,
                    why="a sharded model's full weights gathered to rank 0 under the unwrapped model's names")
    PATCHES.replace(Accelerator, "save_model", _accelerate_writing_once,
                    why="a sharded model written once by rank 0, never half")


def _full_on_rank0(get_state_dict: Any) -> Any:
    @functools.wraps(get_state_dict)
    def gathered(self, model, unwrap=True):
        if (full := _gathered.get()) is not None:
            return full
        if not saving.is_sharded(model):
            return get_state_dict(self, model, unwrap)
        return saving.full_state_dict(model, what="accelerator.get_state_dict")

    return gathered


def _accelerate_writing_once(save_model: Any) -> Any:
    @functools.wraps(save_model)
    def save_once(self, model, save_directory, *args, **kwargs):
        if not saving.is_sharded(model):
            return save_model(self, model, save_directory, *args, **kwargs)
        full = saving.full_state_dict(model, what="accelerator.save_model")

        def write(staging: Path) -> None:
            token = _gathered.set(full)
            try:
                _write_as_one_process(model, lambda: save_model(self, model, staging, *args, **kwargs))
            finally:
                _gathered.reset(token)

        saving.write_together(save_directory, write, what="saving the model (accelerator.save_model)")

    return save_once


def _gathering(save_pretrained: Any) -> Any:
    @functools.wraps(save_pretrained)
    def save_full(self, save_directory, *args, **kwargs):
        if _writing.get() or not saving.is_sharded(self):
            return save_pretrained(self, save_directory, *args, **kwargs)
        given = kwargs.pop("state_dict", None)
        what = f"{type(self).__name__}.save_pretrained"
        kwargs["is_main_process"] = True  # rank 0 writes: no one else is asked
        if given is None:
            full = saving.full_state_dict(self, what=what)
        elif saving.holds_shards(given):  # model.state_dict() of the sharded model
            full = saving.full_tensors_of(given.items(), what=what)
        else:  # gathered before (accelerator.get_state_dict): written alone, see _write_gathered
            return _write_gathered(self, save_directory, lambda staging, state: save_pretrained(
                self, staging, *args, state_dict=state, **kwargs), given, what=f"saving the model ({what})")

        def write(staging: Path) -> None:
            _write_as_one_process(self, lambda: save_pretrained(self, staging, *args, state_dict=full, **kwargs))

        saving.write_together(save_directory, write, what=f"saving the model ({what})")

    return save_full


def _gathering_adapters(save_pretrained: Any) -> Any:
    @functools.wraps(save_pretrained)
    def save_adapters(self, save_directory, *args, **kwargs):
        if _writing.get() or not saving.is_sharded(self):
            return save_pretrained(self, save_directory, *args, **kwargs)
        what = f"{type(self).__name__}.save_pretrained"
        given = kwargs.pop("state_dict", None)
        kwargs["is_main_process"] = True
        if given is None:
            # What peft's get_peft_model_state_dict picks from: the trainable tensors (the adapters,
            # modules_to_save) and any bias (bias="all"), not the frozen base: it stays sharded.
            trainable = {name for name, param in self.named_parameters() if param.requires_grad}
            kwargs["state_dict"] = saving.full_tensors(
                self, what=what, select=lambda name, tensor: (name in trainable or "lora_" in name
                                                              or "modules_to_save" in name or name.endswith("bias")))
        elif saving.holds_shards(given):
            kwargs["state_dict"] = saving.full_tensors_of(given.items(), what=what)
        else:
            return _write_gathered(self, save_directory, lambda staging, state: save_pretrained(
                self, staging, *args, state_dict=state, **kwargs), given, what=f"saving the adapters ({what})")

        def write(staging: Path) -> None:
            _write_as_one_process(self, lambda: save_pretrained(self, staging, *args, **kwargs))

        saving.write_together(save_directory, write, what=f"saving the adapters ({what})")

    return save_adapters


def _write_gathered(model: Any, save_directory: Any, save: Any, state: dict, *, what: str) -> None:
    """A state dict gathered before the call (whole tensors: `accelerator.get_state_dict(model)`,
    the full weights on rank 0 and {} elsewhere) needs no other rank: rank 0 writes it, whether
    the call is on every rank or under `if accelerator.is_main_process:`, and the others return
    at once, as transformers' `is_main_process=False` does (wait_for_everyone before reading it
    back, as there)."""
    if not saving.is_main_rank():
        return
    state = {name.replace(saving.CHECKPOINT_WRAPPER, ""): tensor for name, tensor in state.items()}
    saving.write_here(save_directory, lambda staging: _write_as_one_process(model, lambda: save(staging, state)),
                      what=what)


def _saving_full_weights(save_model: Any) -> Any:
    @functools.wraps(save_model)
    def save_full(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not saving.is_sharded(self.model):
            return save_model(self, output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        full = saving.full_state_dict(self.model, what="Trainer.save_model")
        saving.write_together(output_dir, lambda staging: _write_as_one_process(
                                  self.model, lambda: self._save(str(staging), state_dict=full)),
                              what="saving the model (Trainer.save_model)")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    return save_full


def _write_as_one_process(model: Any, write: Any) -> None:
    """Rank 0 writes the gathered weights as one process would: the save methods called inside
    write as they are, and `model`'s module names are the unwrapped model's (peft finds its
    adapters' keys from the module tree, under the names it built them with)."""
    token = _writing.set(True)
    try:
        with saving.checkpoint_wrappers_lifted(model):
            write()
    finally:
        _writing.reset(token)
