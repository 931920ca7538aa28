"""The worker's entry point for an accelerate script: `python -m cpctl.accelerate_shim SCRIPT ARGS...`.

`cpctl launch` starts it for `launch.script_api: accelerate` (accelerate's variables are already
in the environment, see cpctl.accelerate_env). Before the script runs, three of `Accelerator`'s
methods get a cpctl step in front of accelerate's own (or in place of it), only in this process:

* `__init__`: the Accelerator's parallel sizes must be the profile's (a script that builds its
  own `ParallelismConfig` with other sizes is refused, instead of one of the two being ignored);
* `prepare`, on cpctl's engine: what `rt.prepare_model` does to a model before FSDP (cpctl's
  attention for a Hugging Face model, true positions, the exact `.loss`, tiled MLPs,
  checkpointing whose recompute attends across the CP group), then accelerate's own `prepare`
  (FSDP2, optimizer, data loader), without accelerate's CP hooks on the attention modules;
* `maybe_context_parallel`, on cpctl's engine: `rt.maybe_context_parallel` with the same
  buffers, so the step runs on cpctl's engine (on CPU with gloo too) with its checks. The
  transformers Trainer reaches it the same way (its "is the attention sdpa" check is skipped:
  the model attends through cpctl's implementation).

With `parallelism.cp_engine: native` only the first applies and accelerate's path runs unchanged.
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
from cpctl.accelerate_env import KNOWN_ACCELERATE, is_known
from cpctl.errors import CpctlError


def main(argv: Sequence[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m cpctl.accelerate_shim SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    import cpctl

    if _profile().parallelism.cp_engine == "cpctl":
        runtime = cpctl.init()  # the process group accelerate's PartialState then adopts
        install(runtime.config, runtime)
    else:
        install(_profile(), None)
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
    init, prepare = Accelerator.__init__, Accelerator.prepare

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _check_sizes(self, profile)

    Accelerator.__init__ = checked_init
    if runtime is None:
        return

    @functools.wraps(prepare)
    def cpctl_prepare(self, *args, **kwargs):
        args = tuple(runtime.ready_model(a) if _is_new_model(a) else a for a in args)
        prepared = prepare(self, *args, **kwargs)
        for item in prepared if isinstance(prepared, tuple) else (prepared,):
            if _is_new_model(item):
                runtime.finish_model(item)
                item._cpctl_prepared = True
        return prepared

    def cpctl_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        return runtime.maybe_context_parallel(buffers=list(buffers or []), buffer_seq_dims=list(buffer_seq_dims or []),
                                              no_restore_buffers=no_restore_buffers or ())

    Accelerator.prepare = cpctl_prepare
    _trainer_takes_cpctl_attention()
    for state in (PartialState, AcceleratorState):
        state.destroy_process_group = _closing(state.destroy_process_group)
    if profile.launch.device == "cpu":
        _allow_cpu(profile)
    # accelerate's own CP preparation binds PyTorch's context_parallel and hooks the model's
    # attention modules (dropping masks); cpctl's engine does neither.
    Accelerator._prepare_cp = lambda self, *args: args
    Accelerator.maybe_context_parallel = cpctl_context_parallel


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


def _trainer_takes_cpctl_attention() -> None:
    """The transformers Trainer shards its batch through accelerator.maybe_context_parallel (so
    through cpctl's engine here), after checking that the model's attention is "sdpa". A model
    prepared by cpctl attends through cpctl's implementation, which computes what SDPA would across
    the CP group and checks masks itself; that check alone is the model's use there, so it is
    handed no model."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import Trainer

    prepare_inputs = getattr(Trainer, "_prepare_context_parallel_inputs", None)
    if prepare_inputs is None:  # a Trainer without context parallelism: nothing to adapt
        return

    @functools.wraps(prepare_inputs)
    def without_sdpa_check(self, model, inputs):
        return prepare_inputs(self, None, inputs)

    Trainer._prepare_context_parallel_inputs = without_sdpa_check


def _closing(destroy: Any) -> Any:
    """accelerate's destroy of the default process group, done as cpctl's exit does it."""
    from cpctl import process

    @functools.wraps(destroy)
    def close(self, group=None):
        return destroy(self, group) if group is not None else process.close_process_group()

    return close


def _is_new_model(item: Any) -> bool:
    import torch

    return isinstance(item, torch.nn.Module) and not getattr(item, "_cpctl_prepared", False)


def _check_sizes(accelerator: Any, profile: config.Profile) -> None:
    """The Accelerator's sizes against the profile's: one layout, or a clear error."""
    built = getattr(accelerator, "parallelism_config", None)
    parallel = profile.parallelism
    wanted = {"dp_replicate_size": parallel.dp_replicate_size, "dp_shard_size": parallel.dp_shard_size,
              "cp_size": parallel.cp_size, "tp_size": parallel.tp_size}
    if built is None:
        if parallel.cp_size > 1:
            raise CpctlError(f"the script's Accelerator has no parallelism_config, so cp_size {parallel.cp_size} would be "
                             "ignored; build it as Accelerator() (cpctl sets the environment it reads) or pass "
                             "parallelism_config=ParallelismConfig()")
        return
    got = {name: getattr(built, name, None) for name in wanted}
    differ = [f"{name} {got[name]} (profile: {wanted[name]})" for name in wanted if got[name] != wanted[name]]
    if differ:
        raise CpctlError(f"the script's ParallelismConfig sets {', '.join(differ)}; set the sizes in one place: "
                         "drop them from the script (ParallelismConfig() reads cpctl's) or pass the same to cpctl launch")


if __name__ == "__main__":
    main(sys.argv[1:])
