"""TRL's SFTTrainer on cpctl's engine (TRL releases in cpctl.versions.KNOWN_TRL).

`SFTTrainer` is a transformers Trainer: its training steps shard through the Trainer's own
route (cpctl.integrations.trainer), with TRL's fused LM head computing the loss from the shards.
Two of its own steps are adapted, through the patch registry, when a TRL trainer is first built:

* TRL refuses `packing` under CP (TRL #6843: "context parallelism drops the block-diagonal mask,
  so documents would attend across their boundaries"). That holds for PyTorch's CP; cpctl's
  engine reads packed documents from the restarting position ids TRL's collator makes and keeps
  attention inside each, exactly. On cpctl's engine that refusal (the `cp_enabled` read in
  `SFTTrainer.__init__`, and only there) sees CP off; nothing else changes.
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
from cpctl.runtime import losses
from cpctl.runtime.padding import IGNORE_INDEX
from cpctl.versions import KNOWN_TRL


def install(runtime: Any) -> None:
    """TRL's adaptations for `runtime`, once per process (a known TRL, or one line saying so)."""
    if runtime.seq_size == 1:
        return
    require_known("trl", KNOWN_TRL, what="TRL's trainers under context parallelism")
    from accelerate.parallelism_config import ParallelismConfig
    from trl.trainer.sft_trainer import SFTTrainer

    if PATCHES.is_patched(SFTTrainer, "prediction_step"):
        return
    PATCHES.replace(SFTTrainer, "prediction_step", lambda original: _predicting_under_cp(original, runtime),
                    why="evaluation shards like training; loss and logits are the batch's")
    refusing = inspect.unwrap(SFTTrainer.__init__).__code__
    PATCHES.replace(ParallelismConfig, "cp_enabled", lambda original: _packing_allowed(original, refusing),
                    why="TRL's packing refusal lifted on cpctl's engine, which computes packed documents")


def _packing_allowed(cp_enabled: property, refusing: Any) -> property:
    def read(config):
        if sys._getframe(1).f_code is refusing:  # SFTTrainer.__init__'s packing check: packing is exact here
            return False
        return cp_enabled.fget(config)

    return property(read, doc=cp_enabled.__doc__)


def _predicting_under_cp(prediction_step: Any, runtime: Any) -> Any:
    @functools.wraps(prediction_step)
    def predicted_under_cp(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        if inputs.get("labels") is None:  # no loss to shard for: TRL's own, whole sequences
            return prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        labels = inputs["labels"].detach()  # a handle on the whole labels: the buffers are sharded in place
        context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        before = runtime.last_step
        with torch.no_grad(), self.compute_loss_context_manager(), context():
            if prediction_loss_only:
                loss, logits = self.compute_loss(model, inputs, return_outputs=False), None
            else:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                logits = outputs.logits
            tokens = (inputs["shift_labels"] != IGNORE_INDEX).sum()  # what TRL's mean on this shard divided by
        # TRL's loss is this shard's token mean: weight it by its tokens to get the batch's
        mean, _ = losses.mean_over_ranks(loss.detach().float() * tokens, tokens, group=runtime.seq_group)
        loss = mean.to(loss.dtype)
        step = runtime.last_step
        if logits is not None and step is not before:  # gathered with the step the context above entered
            logits = step.unshard_results(logits)
        return loss, logits, labels

    return predicted_under_cp
