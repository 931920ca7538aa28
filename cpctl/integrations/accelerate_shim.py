"""The worker's entry point for an accelerate script: `python -m cpctl.integrations.accelerate_shim SCRIPT ARGS...`.

`cpctl launch` starts it for `launch.script_api: accelerate` (accelerate's variables are already
in the environment, see cpctl.launch.accelerate_env). Before the script runs, cpctl's steps go in front
of accelerate's (or in place of them), only in this process:

* `Accelerator.__init__`: the Accelerator's parallel sizes must be the profile's (a script that
  builds its own `ParallelismConfig` with other sizes is refused, instead of one of the two
  being ignored). With `parallelism.cp_engine: native` this is all, and accelerate's path runs
  unchanged. On cpctl's engine, also:
* `Accelerator.prepare` / `prepare_model`: what `rt.prepare_model` does to a model before FSDP
  (cpctl's attention for a Hugging Face model, true positions, the exact `.loss`, tiled MLPs,
  checkpointing whose recompute attends across the CP group), once per model, then
  accelerate's own (FSDP2, optimizer, data loader), without its CP hooks on attention modules;
* `Accelerator.maybe_context_parallel`: `rt.maybe_context_parallel` with the same buffers, so
  the step runs on cpctl's engine (on CPU with gloo too) with its checks;
* the transformers Trainer, which reaches that context manager too: see
  `_trainer_takes_cpctl_attention`; and accelerate's process-group teardown, done as cpctl's.

Then the script runs as `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would run it.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from cpctl import config
from cpctl.errors import CpctlError
from cpctl.integrations import accelerate_sp, huggingface
from cpctl.versions import KNOWN_ACCELERATE, is_known


def main(argv: Sequence[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m cpctl.integrations.accelerate_shim SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    import cpctl

    profile = _profile()
    if profile.parallelism.cp_engine == "cpctl":
        runtime = cpctl.init()  # the process group accelerate's PartialState then adopts; its error reports
        install(runtime.config, runtime)
    else:
        try:
            install(profile, None)
        except CpctlError as error:  # no cpctl runtime reports it here: one line, as it would
            raise SystemExit(f"error: {error}") from None
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` puts it first
        runpy.run_path(argv[0], run_name="__main__")


def _profile() -> config.Profile:
    import torch

    return config.for_worker({}, environ=os.environ, cuda_devices=torch.cuda.device_count()).profile


def install(profile: config.Profile, runtime: Any | None) -> None:
    """Put cpctl's steps in front of accelerate's (runtime None: the native engine, checks only)."""
    try:
        import accelerate
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, PartialState
    except ImportError:
        raise CpctlError("launch.script_api: accelerate, but accelerate is not installed here; "
                         "pip install accelerate, or set script_api: cpctl") from None
    if not is_known(accelerate.__version__, KNOWN_ACCELERATE):
        raise CpctlError(f"accelerate {accelerate.__version__} is not a release cpctl knows ({', '.join(KNOWN_ACCELERATE)}): "
                         "the settings cpctl passes may be read differently; install one of those")
    init = Accelerator.__init__

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        if kwargs.get("parallelism_config") is not None:  # before accelerate builds a mesh of other sizes
            _check_config_sizes(kwargs["parallelism_config"], profile)
        init(self, *args, **kwargs)
        _check_sizes(self, profile)

    Accelerator.__init__ = checked_init
    if runtime is None:
        return
    accelerate_sp.show_sp_as_cp()  # sp_size runs on cpctl's Ulysses: accelerate sees cp x sp ranks as cp
    # `prepare` (FSDP2 prepares models without prepare_model) and `prepare_model` (which
    # `prepare` may call, and the Trainer calls alone to evaluate) both adopt the model, once.
    Accelerator.prepare = _adopting(Accelerator.prepare, runtime)
    Accelerator.prepare_model = _adopting(Accelerator.prepare_model, runtime)

    def cpctl_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        return runtime.maybe_context_parallel(buffers=list(buffers or []), buffer_seq_dims=list(buffer_seq_dims or []),
                                              no_restore_buffers=no_restore_buffers or ())

    # accelerate's own CP preparation binds PyTorch's context_parallel and hooks the model's
    # attention modules (dropping masks); cpctl's engine does neither.
    Accelerator._prepare_cp = lambda self, *args: args
    Accelerator.maybe_context_parallel = cpctl_context_parallel
    _trainer_takes_cpctl_attention(runtime)
    for state in (PartialState, AcceleratorState):
        state.destroy_process_group = _closing(state.destroy_process_group)
    if profile.launch.device == "cpu":
        _allow_cpu(profile)


ADOPTED = "_cpctl_adopted"  # set on a model cpctl has prepared, so a second prepare leaves it alone


def _adopting(prepare: Any, runtime: Any) -> Any:
    """`prepare` (or `prepare_model`) with the models among its arguments made ready by cpctl
    before accelerate wraps them, and finished after."""
    import torch

    @functools.wraps(prepare)
    def adopting(self, *args, **kwargs):
        fresh = [a for a in (*args, *kwargs.values())
                 if isinstance(a, torch.nn.Module) and not getattr(a, ADOPTED, False)]
        for model in fresh:
            runtime.ready_model(model)
            setattr(model, ADOPTED, True)
        prepared = prepare(self, *args, **kwargs)
        for model in fresh:
            runtime.finish_model(model)
        for item in prepared if isinstance(prepared, tuple) else (prepared,):
            if isinstance(item, torch.nn.Module):
                setattr(item, ADOPTED, True)  # a wrapper (DDP) passed back in later
        return prepared

    return adopting


def _allow_cpu(profile: config.Profile) -> None:
    """accelerate runs FSDP and its ParallelismConfig on accelerators only: on cpu (MULTI_CPU)
    it replicates the model with DDP, which averages gradients over the same dp x cp ranks, and
    cpctl's engine computes CP. Its one check that would refuse that is skipped there."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    validate = ParallelismConfig._validate_accelerator

    @functools.wraps(validate)
    def validate_on_cpu(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            return validate(self, accelerator)
        if self.total_size != accelerator.num_processes:  # what accelerate's own check would say first
            raise CpctlError(f"the Accelerator's ParallelismConfig covers {self.total_size} processes, "
                             f"the job has {accelerator.num_processes}")
        return None

    ParallelismConfig._validate_accelerator = validate_on_cpu


def _trainer_takes_cpctl_attention(runtime: Any) -> None:
    """The transformers Trainer shards its batch through accelerator.maybe_context_parallel (so
    through cpctl's engine here). Two of its steps are adapted:

    * it checks that the model's attention is "sdpa": a model cpctl prepared attends through
      cpctl's implementation, which computes what SDPA would across the CP group and checks
      masks itself, so for such a model (only) the check is not made;
    * its loss is the model's local sum over its own count of label tokens (num_items_in_batch),
      scaled so that the gradient average over dp x cp gives the global mean: inside its
      compute_loss the runtime lets the model take that count instead of refusing it; in
      evaluation the CP ranks' losses are averaged, since only one CP rank's loss is kept.
    """
    import importlib.util

    import torch

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import Trainer

    prepare_inputs = getattr(Trainer, "_prepare_context_parallel_inputs", None)
    compute_loss = Trainer.compute_loss
    if prepare_inputs is None:  # a Trainer without context parallelism: nothing to adapt
        return

    @functools.wraps(prepare_inputs)
    def checked_as_cpctl(self, model, inputs):
        config = getattr(self.accelerator.unwrap_model(model), "config", None)
        cpctl_attention = getattr(config, "_attn_implementation", None) == huggingface.IMPLEMENTATION
        return prepare_inputs(self, None if cpctl_attention else model, inputs)

    @functools.wraps(compute_loss)
    def counted_by_the_trainer(self, model, *args, **kwargs):
        if model.training and runtime.world_size > 1 and not _averages_gradients(model):
            raise CpctlError(f"the Trainer trains a model that no DDP or FSDP wraps, on {runtime.world_size} processes: "
                             "their gradients would never be averaged (transformers skips the wrapping when "
                             "trainer.evaluate() runs before trainer.train()); call train() first")
        with runtime.caller_counts_loss_tokens():
            result = compute_loss(self, model, *args, **kwargs)
        if model.training or runtime.seq_size == 1:
            return result
        # Evaluation: each CP rank's loss covers its shard only, and accelerate's
        # gather_for_metrics keeps one CP rank's value (they hold the same samples); give every
        # CP rank their mean, which is the batch's loss (the Trainer scaled each by the ranks).
        loss = result[0] if isinstance(result, tuple) else result
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=runtime.seq_group)
        loss /= runtime.seq_size
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    Trainer._prepare_context_parallel_inputs = checked_as_cpctl
    Trainer.compute_loss = counted_by_the_trainer


def _averages_gradients(model: Any) -> bool:
    """Whether `model` is wrapped by something that averages gradients over the ranks."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.6 keeps FSDP2 here
        from torch.distributed._composable.fsdp import FSDPModule

    return isinstance(model, (DistributedDataParallel, FSDPModule, FullyShardedDataParallel))


def _closing(destroy: Any) -> Any:
    """accelerate's destroy of the default process group, done as cpctl's exit does it."""
    from cpctl.runtime import process

    @functools.wraps(destroy)
    def close(self, group=None):
        return destroy(self, group) if group is not None else process.close_process_group()

    return close


def _check_sizes(accelerator: Any, profile: config.Profile) -> None:
    """The Accelerator's sizes against the profile's: one layout, or a clear error."""
    built = getattr(accelerator, "parallelism_config", None)
    parallel = profile.parallelism
    if built is None:
        if parallel.cp_size * parallel.sp_size > 1:
            sizes = f"cp_size {parallel.cp_size}" + (f" and sp_size {parallel.sp_size}" if parallel.sp_size > 1 else "")
            raise CpctlError(f"the script's Accelerator has no parallelism_config, so {sizes} would be ignored; build "
                             "it as Accelerator() (cpctl sets the environment it reads) or pass "
                             "parallelism_config=ParallelismConfig()")
        return
    _check_config_sizes(built, profile)


def _check_config_sizes(built: Any, profile: config.Profile) -> None:
    """A ParallelismConfig's sizes (as the script asked them) against the profile's."""
    parallel = profile.parallelism
    wanted = {"dp_replicate_size": parallel.dp_replicate_size, "dp_shard_size": parallel.dp_shard_size,
              "cp_size": parallel.cp_size, "sp_size": parallel.sp_size, "tp_size": parallel.tp_size}
    got = {name: getattr(built, name, None) for name in wanted} | accelerate_sp.requested(built)
    differ = [f"{name} {got[name]} (profile: {wanted[name]})" for name in wanted if got[name] != wanted[name]]
    if differ:
        raise CpctlError(f"the script's ParallelismConfig sets {', '.join(differ)}; set the sizes in one place: "
                         "drop them from the script (ParallelismConfig() reads cpctl's) or pass the same to cpctl launch")


if __name__ == "__main__":
    main(sys.argv[1:])
