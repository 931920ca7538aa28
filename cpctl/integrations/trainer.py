"""The transformers Trainer on cpctl's engine: what it does under CP, made one process's.

The Trainer shards each batch through `accelerator.maybe_context_parallel` (its
`_prepare_context_parallel_inputs`), so through cpctl's engine on the accelerate route. Its
steps are adapted, in the worker only, through the patch registry (cpctl.integrations.patches):

* `_prepare_context_parallel_inputs`: the "attention must be sdpa" check is skipped for a model
  cpctl prepared (its attention is cpctl's implementation, which checks masks itself), and the
  buffers go to `rt.maybe_context_parallel` with what to append by name when a length does not
  divide (labels -100, attention mask 0, positions counted on: cpctl.runtime.padding);
* `compute_loss`: a training step with `label_smoothing_factor` (its smoother shifts each shard's
  labels itself), or whose loss an override computed without it, is refused; its loss
  is the model's local sum over the Trainer's own count of label tokens
  (`num_items_in_batch`), scaled so that the gradient average over dp x cp gives the global mean:
  inside it the runtime lets the model take that count; in evaluation the CP ranks' losses are
  averaged, since accelerate's `gather_for_metrics` may keep one CP rank's value;
* `prediction_step`: the logits of a sharded step are gathered back over the CP group in token
  order (without the appended tokens), so predictions line up with the labels, which the Trainer
  keeps whole: `compute_metrics` and `preprocess_logits_for_metrics` see one process's arrays;
* `__init__`: a TRL trainer gets TRL's adaptations (cpctl.integrations.trl) on first use;
* `TrainingArguments.__post_init__`: `bf16=True` / `fp16=True` in the script must be the
  profile's `fsdp.mixed_precision` (TrainingArguments would otherwise win over the launch
  silently, and refuse bf16 on a CPU with a message about `use_cpu`); when both say bf16 on a
  CPU launch, transformers is told the run is on the CPU, where torch computes bf16 too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cpctl.errors import CpctlError
from cpctl.integrations import huggingface
from cpctl.integrations.patches import PATCHES, require_known
from cpctl.runtime import losses
from cpctl.runtime.context import StepContext
from cpctl.runtime.padding import IGNORE_INDEX, POSITIONS
from cpctl.runtime.parallelize import fsdp2
from cpctl.versions import KNOWN_TRANSFORMERS

# What the Trainer's inputs append, by name, when a length does not divide (others: cpctl's rule).
PAD_BY_NAME = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": POSITIONS}


def install(context: StepContext) -> None:
    """Adapt transformers' Trainer (if installed) to cpctl's engine for this step context."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import Trainer, TrainingArguments

    PATCHES.replace(TrainingArguments, "__post_init__", lambda original: _precision_checked(original, context.config),
                    why="the script's bf16/fp16 must be the profile's mixed precision")

    if getattr(Trainer, "_prepare_context_parallel_inputs", None) is None:
        return  # a Trainer without context parallelism: nothing to adapt
    if context.mesh.seq_enabled:
        require_known("transformers", KNOWN_TRANSFORMERS, what="the Trainer under context parallelism")
    PATCHES.replace(Trainer, "_prepare_context_parallel_inputs", lambda original: _sharding(original, context),
                    why="shards through cpctl's engine, padding by name; no sdpa-name check for cpctl's attention")
    PATCHES.replace(Trainer, "compute_loss", lambda original: _counting(original, context),
                    why="the Trainer's token count is exact under CP; CP ranks' evaluation losses averaged")
    PATCHES.replace(Trainer, "prediction_step", lambda original: predicting(original, context),
                    why="logits of a sharded step gathered in token order for metrics")
    PATCHES.replace(Trainer, "__init__", lambda original: _noticing_trl(original, context),
                    why="a TRL trainer gets TRL's adaptations")


def _precision_checked(post_init: Any, profile: Any) -> Any:
    @functools.wraps(post_init)
    def checked(self, *args, **kwargs):
        asked = "bf16" if self.bf16 else "fp16" if self.fp16 else None
        wanted = profile.fsdp.mixed_precision
        if asked is not None and asked != wanted:
            raise CpctlError(f"the script's TrainingArguments set {asked}=True (profile: fsdp.mixed_precision {wanted}); "
                             f"set the precision in one place: {asked}=False in the script (--{asked} false where it "
                             f"parses TrainingArguments, as TRL's and transformers' scripts do), or cpctl launch "
                             f"--mixed-precision {asked}")
        if asked is not None and profile.launch.device == "cpu":
            self.use_cpu = True  # the launch is on the CPU: transformers allows bf16 there only when told so
        return post_init(self, *args, **kwargs)

    return checked


# Trainer.compute_loss calls so far in this thread: a sharded training step that made none
# computed its loss in an override of its own
_LOSSES_COUNTED: contextvars.ContextVar[int] = contextvars.ContextVar("cpctl_trainer_losses_counted", default=0)


@contextlib.contextmanager
def _through_the_trainers_loss(step: Any, trainer: Any, model: Any) -> Iterator[None]:
    """A step's CP context that, for a training step, refuses what made its loss one shard's: label
    smoothing (the smoother shifts each shard's labels itself), and a loss an override computed
    without Trainer.compute_loss (TRL's own, which cpctl adapts, excepted). Told at the end of the
    step, before any update: only there is the mode known (training_step calls model.train() inside
    the context, and a model from from_pretrained arrives in eval mode)."""
    counted = _LOSSES_COUNTED.get()
    with step():
        yield
    if not model.training:  # an evaluation's step: it may call the model without a loss
        return
    if getattr(trainer, "label_smoother", None) is not None:
        raise CpctlError(f"label_smoothing_factor {trainer.args.label_smoothing_factor} under context parallelism: "
                         "the Trainer's LabelSmoother shifts the labels of each rank's shard itself (each shard's last "
                         "target lost) and averages per shard, so its loss is not one process's; set "
                         "label_smoothing_factor=0")
    if _LOSSES_COUNTED.get() != counted:
        return
    owner = next(cls for cls in type(trainer).__mro__ if "compute_loss" in vars(cls))
    if not owner.__module__.startswith("trl."):
        raise CpctlError(f"{owner.__name__}.compute_loss computed the training loss without Trainer.compute_loss: "
                         "under context parallelism each rank holds a shard of every sequence (its labels already "
                         "shifted), so a loss written for whole sequences is not one process's; return "
                         "super().compute_loss(model, inputs, return_outputs, num_items_in_batch) from it (the "
                         "model's own loss, exact under CP), adding your terms to that")


def _sharding(prepare_inputs: Any, context: StepContext) -> Any:
    @functools.wraps(prepare_inputs)
    def sharding(self, model, inputs):
        config = getattr(self.accelerator.unwrap_model(model), "config", None)
        cpctl_attention = getattr(config, "_attn_implementation", None) == huggingface.IMPLEMENTATION
        trainer_context, inputs = prepare_inputs(self, None if cpctl_attention else model, inputs)
        buffers = getattr(trainer_context, "keywords", {}).get("buffers")
        if buffers is None:  # CP is off: the Trainer's own null context
            return trainer_context, inputs
        names = {id(tensor): name for name, tensor in inputs.items() if isinstance(tensor, torch.Tensor)}
        pad_values = [PAD_BY_NAME.get(names.get(id(buffer))) for buffer in buffers]
        step = functools.partial(context.maybe_context_parallel, buffers=buffers,
                                 buffer_seq_dims=trainer_context.keywords["buffer_seq_dims"],
                                 no_restore_buffers=trainer_context.keywords["no_restore_buffers"],
                                 pad_values=pad_values)
        return functools.partial(_through_the_trainers_loss, step, self, model), inputs

    return sharding


def _counting(compute_loss: Any, context: StepContext) -> Any:
    @functools.wraps(compute_loss)
    def counted_by_the_trainer(self, model, *args, **kwargs):
        _LOSSES_COUNTED.set(_LOSSES_COUNTED.get() + 1)
        world_size = dist.get_world_size()
        if model.training and world_size > 1 and not averages_gradients(model):
            raise CpctlError(f"the Trainer trains a model that no DDP or FSDP wraps, on {world_size} processes: "
                             "their gradients would never be averaged (transformers skips the wrapping when "
                             "trainer.evaluate() runs before trainer.train()); call train() first")
        with context.caller_counts_loss_tokens():
            result = compute_loss(self, model, *args, **kwargs)
        if model.training or not context.mesh.seq_enabled:
            return result
        loss = result[0] if isinstance(result, tuple) else result
        loss = cp_mean(context, loss)
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    return counted_by_the_trainer


def cp_mean(context: StepContext, loss: torch.Tensor) -> torch.Tensor:
    """Each CP rank's loss covers its shard (scaled by the Trainer by the number of ranks):
    their mean is the batch's loss, given to every CP rank."""
    mean, _ = losses.mean_over_ranks(loss, 1, group=context.seq_group)
    return mean.to(loss.dtype)


def predicting(prediction_step: Any, context: StepContext) -> Any:
    """`prediction_step` whose logits, when the step was sharded, are gathered back whole."""
    @functools.wraps(prediction_step)
    def predicted_whole(self, model, inputs, *args, **kwargs):
        before = context.last_step
        loss, logits, labels = prediction_step(self, model, inputs, *args, **kwargs)
        step = context.last_step
        if logits is not None and step is not before and context.mesh.seq_enabled:
            logits = step.unshard_results(logits)
        return loss, logits, labels

    return predicted_whole


def _noticing_trl(init: Any, context: StepContext) -> Any:
    @functools.wraps(init)
    def init_noticing_trl(self, *args, **kwargs):
        if "trl" in sys.modules and any(cls.__module__.startswith("trl.") for cls in type(self).__mro__):
            from cpctl.integrations import trl

            trl.install(context)
        return init(self, *args, **kwargs)

    return init_noticing_trl


def averages_gradients(model: Any) -> bool:
    """Whether `model` is wrapped by something that averages gradients over the ranks."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (DistributedDataParallel, fsdp2().FSDPModule, FullyShardedDataParallel))
