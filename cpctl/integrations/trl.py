"""TRL's SFTTrainer on cpctl's engine (TRL releases in cpctl.versions.KNOWN_TRL).

`SFTTrainer` is a transformers Trainer: its training steps shard through the Trainer's own
route (cpctl.integrations.trainer), with TRL's fused LM head computing the loss from the shards.
Two of its own steps are adapted, through the patch registry, when a TRL trainer is first built:

* TRL refuses `packing` under CP (TRL #6843: "context parallelism drops the block-diagonal mask,
  so documents would attend across their boundaries"). That holds for PyTorch's CP; cpctl's
  engine reads packed documents from the restarting position ids TRL's collator makes and keeps
  attention inside each, exactly. On cpctl's engine that refusal (the `cp_enabled` read in
  `SFTTrainer.__init__`, and only there) sees CP off; nothing else changes. TRL offers no seam
  for it: the refusal is inline, after `Trainer.__init__`, and cpctl first sees a TRL trainer
  from inside that `Trainer.__init__` (so cannot wrap the `SFTTrainer.__init__` already running).
  So the read is told by the code object it comes from, and install checks that this code
  reads `cp_enabled` exactly once, next to the packing flags (`PACKING_REFUSAL`).
* TRL's `prediction_step` runs the model on whole sequences, without CP. Here it shards like a
  training step; the loss is the batch's token mean over the CP ranks (each rank's mean is
  weighted by its own label tokens), and the logits, when asked for, are gathered back in
  token order, so `eval_loss`, `eval_mean_token_accuracy` and `eval_entropy` are one process's.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from cpctl.integrations.patches import PATCHES, require_known
from cpctl.upstream import Shape, require_shape
from cpctl.runtime import losses
from cpctl.runtime.context import StepContext
from cpctl.runtime.padding import IGNORE_INDEX
from cpctl.versions import KNOWN_TRL

# SFTTrainer.__init__'s packing refusal, the one read of cp_enabled there that is answered "off".
PACKING_REFUSAL = Shape(reads_once=("cp_enabled",), reads=("packing", "eval_packing"))
# What the sharded prediction_step passes TRL's, and the Trainer's methods it runs the step with.
PREDICTION_STEP = Shape(parameters=("model", "inputs", "prediction_loss_only", "ignore_keys"),
                        uses=("_prepare_inputs", "_prepare_context_parallel_inputs", "compute_loss_context_manager",
                              "compute_loss"))


def install(context: StepContext) -> None:
    """TRL's adaptations for this step context, once per process (a known TRL, or one line saying so)."""
    if not context.mesh.seq_enabled:
        return
    require_known("trl", KNOWN_TRL, what="TRL's trainers under context parallelism")
    from accelerate.parallelism_config import ParallelismConfig
    from trl.trainer.sft_trainer import SFTTrainer

    if PATCHES.is_patched(SFTTrainer, "prediction_step"):
        return
    require_shape(SFTTrainer, "__init__", PACKING_REFUSAL)
    PATCHES.replace(SFTTrainer, "prediction_step", lambda original: _predicting_under_cp(original, context),
                    why="evaluation shards like training; loss and logits are the batch's", needs=PREDICTION_STEP)
    refusing = inspect.unwrap(SFTTrainer.__init__).__code__
    PATCHES.replace(ParallelismConfig, "cp_enabled", lambda original: _packing_allowed(original, refusing),
                    why="TRL's packing refusal lifted on cpctl's engine, which computes packed documents",
                    needs=Shape(kind=property))


def _packing_allowed(cp_enabled: property, refusing: Any) -> property:
    def read(config):
        if sys._getframe(1).f_code is refusing:  # read by SFTTrainer.__init__: its packing refusal, exact here
            return False
        return cp_enabled.fget(config)

    return property(read, doc=cp_enabled.__doc__)


def _predicting_under_cp(prediction_step: Any, context: StepContext) -> Any:
    @functools.wraps(prediction_step)
    def predicted_under_cp(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        if inputs.get("labels") is None:  # no loss to shard for: TRL's own, whole sequences
            return prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        labels = inputs["labels"].detach()  # a handle on the whole labels: the buffers are sharded in place
        sharding, inputs = self._prepare_context_parallel_inputs(model, inputs)
        before = context.last_step
        with torch.no_grad(), self.compute_loss_context_manager(), sharding():
            if prediction_loss_only:
                loss, logits = self.compute_loss(model, inputs, return_outputs=False), None
            else:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                logits = outputs.logits
            tokens = (inputs["shift_labels"] != IGNORE_INDEX).sum()  # what TRL's mean on this shard divided by
        # TRL's loss is this shard's token mean: weight it by its tokens to get the batch's
        mean, _ = losses.mean_over_ranks(loss.detach().float() * tokens, tokens, group=context.seq_group)
        loss = mean.to(loss.dtype)
        step = context.last_step
        if logits is not None and step is not before:  # gathered with the step the context above entered
            logits = step.unshard_results(logits)
        return loss, logits, labels

    return predicted_under_cp
