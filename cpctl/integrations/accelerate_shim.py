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
* the transformers Trainer (and TRL's trainers), which reach that context manager too: see
  cpctl.integrations.trainer; and accelerate's process-group teardown, done as cpctl's.

Every one of those changes goes through cpctl.integrations.patches, the one registry of what
cpctl changes in other libraries.

Then the script runs as `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would run it.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from cpctl import config, upstream
from cpctl.errors import CpctlError
from cpctl.integrations import accelerate_sp, fsdp_saving, hf_loading, trainer
from cpctl.integrations.patches import PATCHES
from cpctl.upstream import Shape
from cpctl.runtime.context import StepContext
from cpctl.runtime.preparation import ModelPreparation
from cpctl.runtime.runtime import Runtime, preparation, step_context
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


def install(profile: config.Profile, runtime: Runtime | None) -> None:
    """Put cpctl's steps in front of accelerate's (runtime None: the native engine, checks only).
    Every change goes through the patch registry (cpctl.integrations.patches)."""
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
    PATCHES.replace(Accelerator, "__init__", lambda init: _checking_sizes(init, profile),
                    why="the script's parallel sizes and strategy must be the profile's",
                    needs=Shape(parameters=("parallelism_config", "mixed_precision"), uses=("parallelism_config",)))
    if runtime is None:
        return
    from accelerate.parallelism_config import ParallelismConfig

    context = step_context(runtime)

    PATCHES.replace(ParallelismConfig, "__post_init__", accelerate_sp.sp_shown_as_cp,
                    why="sp_size runs on cpctl's Ulysses: accelerate sees the cp x sp ranks as cp",
                    needs=accelerate_sp.POST_INIT_SHAPE)
    # `prepare` (FSDP2 prepares models without prepare_model) and `prepare_model` (which
    # `prepare` may call, and the Trainer calls alone to evaluate) both adopt the model, once.
    for name in ("prepare", "prepare_model"):
        PATCHES.replace(Accelerator, name, lambda prepare: _adopting(prepare, preparation(runtime), main=runtime.is_main),
                        why="models get cpctl's preparation before accelerate wraps them")

    def cpctl_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        return context.maybe_context_parallel(buffers=list(buffers or []), buffer_seq_dims=list(buffer_seq_dims or []),
                                              no_restore_buffers=no_restore_buffers or ())

    # accelerate's own CP preparation binds PyTorch's context_parallel and hooks the model's
    # attention modules (dropping masks); cpctl's engine does neither.
    PATCHES.replace(Accelerator, "_prepare_cp", lambda original: lambda self, *args: args,
                    why="no PyTorch context_parallel hooks on attention modules", needs=Shape(parameters=("args",)))
    PATCHES.replace(Accelerator, "maybe_context_parallel", lambda original: cpctl_context_parallel,
                    why="rt.maybe_context_parallel: cpctl's engine",
                    needs=Shape(parameters=("buffers", "buffer_seq_dims", "no_restore_buffers")))
    if context.mesh.seq_enabled:
        _install_once_per_sequence(Accelerator, context)
        _install_schedule_per_batch(context.mesh.dp_size)
    trainer.install(context)
    fsdp_saving.install_accelerate()
    hf_loading.install(runtime)
    for state in (PartialState, AcceleratorState):
        PATCHES.replace(state, "destroy_process_group", _closing, why="teardown as cpctl's exit does it",
                        needs=Shape(parameters=("group",)))
    if profile.launch.device == "cpu":
        _fsdp_on_cpu()


def _checking_sizes(init: Any, profile: config.Profile) -> Any:
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        given = arguments.get("parallelism_config")
        if given is not None:  # before accelerate reads it: the same message on every device
            _check_sizes(given, profile)
        precision = arguments.get("mixed_precision")
        wanted = profile.fsdp.mixed_precision
        if precision is not None and str(getattr(precision, "value", precision)) != wanted:
            precision = getattr(precision, "value", precision)
            raise CpctlError(f"the script's Accelerator sets mixed_precision={precision!r} (profile: fsdp.mixed_precision "
                             f"{wanted}); set it in one place: Accelerator() without it (it reads cpctl's), or cpctl "
                             f"launch --mixed-precision {precision}")
        init(self, *args, **kwargs)
        if given is None:
            _check_sizes(getattr(self, "parallelism_config", None), profile)

    return checked_init


ADOPTED = "adopted"  # noted (patch registry) for a model cpctl has prepared, so a second prepare leaves it alone


def _adopted(model: Any) -> bool:
    """Whether cpctl prepared this model, or the model a wrapper forwards to (torch.compile's
    `_orig_mod`, peft's base model): a wrapper built around a prepared model is not prepared again."""
    seen: set[int] = set()
    while model is not None and id(model) not in seen:
        if PATCHES.noted(model, ADOPTED, False):
            return True
        seen.add(id(model))
        inner = upstream.uncompiled(model)
        if inner is model:
            inner = model.get_base_model() if callable(getattr(type(model), "get_base_model", None)) else None
        model = inner
    return False


def _adopting(prepare: Any, steps: ModelPreparation, *, main: bool) -> Any:
    """`prepare` (or `prepare_model`) with the models among its arguments made ready by cpctl
    before accelerate wraps them, and finished after."""
    import torch

    from cpctl.runtime.parallelize import master_weights_for_fsdp

    @functools.wraps(prepare)
    def adopting(self, *args, **kwargs):
        fresh = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Module) and not _adopted(a)]
        for model in fresh:
            steps.before_fsdp(model)
            if steps.config.fsdp.version == 2:  # fp32 master weights whatever accelerate's mixed_precision
                master_weights_for_fsdp(model, master_weights=steps.config.fsdp.master_weights, main=main,
                                        placeholders=hf_loading.has_placeholders(model))
            PATCHES.note(model, ADOPTED, True)
        plugin = getattr(self.state, "fsdp_plugin", None)
        was = getattr(plugin, "cpu_ram_efficient_loading", None)
        if plugin is not None and any(hf_loading.sends_from_rank0(model) for model in fresh):
            # accelerate's own path for weights only rank 0 holds: shard on meta, then rank 0 sends;
            # for this call only, so a model every rank built itself is prepared as it was
            plugin.cpu_ram_efficient_loading = True
        try:
            prepared = prepare(self, *args, **kwargs)
        finally:
            if plugin is not None:
                plugin.cpu_ram_efficient_loading = was
        for model in fresh:
            steps.after_fsdp(model)
            hf_loading.filled(model)
        for item in prepared if isinstance(prepared, tuple) else (prepared,):
            if isinstance(item, torch.nn.Module):
                PATCHES.note(item, ADOPTED, True)  # a wrapper (DDP) passed back in later
        return prepared

    return adopting


# The Accelerator whose gather_for_metrics is running in this context: its `gather` keeps one CP rank per group.
_GATHERING_FOR_METRICS: contextvars.ContextVar[Any] = contextvars.ContextVar("gathering_for_metrics", default=None)


def _install_schedule_per_batch(data_ranks: int) -> None:
    """A scheduler given to `prepare` steps once per process at each optimizer step (accelerate
    counts every process as a batch of its own); the ranks that split a sequence share theirs, so
    it steps once per data-parallel rank: the schedule one process with the same global batch has."""
    from accelerate.scheduler import AcceleratedScheduler

    def per_batch(step: Any) -> Any:
        @functools.wraps(step)
        def stepped(self, *args, **kwargs):
            if self.split_batches or not self.step_with_optimizer or not self.gradient_state.sync_gradients:
                return step(self, *args, **kwargs)  # one step, or none, whatever the processes
            self.split_batches = True  # accelerate's own one-step path, taken once per data-parallel rank
            try:
                for _ in range(data_ranks):
                    total = getattr(self.scheduler, "total_steps", None)  # OneCycle: never past its end
                    if total is not None and self.scheduler._step_count > total:
                        break
                    step(self, *args, **kwargs)
            finally:
                self.split_batches = False

        return stepped

    PATCHES.replace(AcceleratedScheduler, "step", per_batch,
                    why="one scheduler step per data-parallel rank: the CP ranks of a group share each batch",
                    needs=Shape(reads=("split_batches", "step_with_optimizer", "num_processes")))


def _install_once_per_sequence(accelerator_class: type, context: StepContext) -> None:
    """accelerate's gather_for_metrics gathers from every process, and at the end of a data loader
    keeps the first `remainder` samples: under CP every sample came once per CP rank, so the
    weights of the batches (and what the truncation keeps) would not be one process's. Here the
    data its `gather` returns keeps one CP rank per group. Inside a sharded step a scalar is one
    shard's part (a count, a sum: TRL's token metrics) and is summed over the CP group first."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import recursively_apply

    leaders = context.mesh.sequence_leaders()  # one rank per sequence: the first of its cp x sp ranks
    world = context.mesh.root.mesh.numel()

    def leaders_only(data: Any) -> Any:
        return data.view(world, -1, *data.shape[1:])[leaders].flatten(0, 1)

    def summed_over_cp(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() != 0:
            raise CpctlError(f"gather_for_metrics of a {tuple(tensor.shape)} tensor inside maybe_context_parallel: it "
                             "holds one shard of the sequence; gather it after the context (or rt.unshard it first)")
        total = tensor.detach().clone()
        dist.all_reduce(total, group=context.seq_group)
        return total

    def tensors_only(data: Any) -> bool:
        try:
            recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
        except TypeError:
            return False
        return True

    def once_per_sequence(gather_for_metrics: Any) -> Any:
        @functools.wraps(gather_for_metrics)
        def gathered_once(self, input_data, use_gather_object=False):
            if use_gather_object or not tensors_only(input_data):  # accelerate would gather objects, once per rank
                raise CpctlError("gather_for_metrics of Python objects under context parallelism: cpctl keeps one "
                                 "copy per CP group of tensors only; gather tensors (eval_use_gather_object=False)")
            if context.cp_active:
                input_data = recursively_apply(summed_over_cp, input_data)
            token = _GATHERING_FOR_METRICS.set(self)
            try:
                return gather_for_metrics(self, input_data, use_gather_object=False)
            finally:
                _GATHERING_FOR_METRICS.reset(token)

        return gathered_once

    def leaders_inside_metrics(gather: Any) -> Any:
        @functools.wraps(gather)
        def gathered(self, tensor):
            data = gather(self, tensor)
            return recursively_apply(leaders_only, data) if _GATHERING_FOR_METRICS.get() is self else data

        return gathered

    PATCHES.replace(accelerator_class, "gather_for_metrics", once_per_sequence,
                    why="the CP ranks of a group hold the same samples: one copy each, as one process has",
                    needs=Shape(parameters=("input_data", "use_gather_object"), reads=("gather",)))
    PATCHES.replace(accelerator_class, "gather", leaders_inside_metrics,
                    why="inside gather_for_metrics: one CP rank's copy per group", needs=Shape(parameters=("tensor",)))


def _fsdp_on_cpu() -> None:
    """accelerate applies FSDP (and ParallelismConfig's mesh) on accelerators only: on the CPU
    (MULTI_CPU) it would replicate the model with DDP, whose wrapper hides `model.config` and
    `save_pretrained`. cpctl's own route runs FSDP2 on the CPU with gloo; so does this one: the
    state takes the FSDP plugin on the CPU exactly as it does on a GPU, and accelerate's FSDP2
    preparation (device-agnostic) shards the model over the CPU mesh."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    def fsdp_too(init):
        @functools.wraps(init)
        def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
            init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
                self.distributed_type = DistributedType.FSDP  # what the GPU branch of __init__ sets
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = fsdp_plugin
                # as __init__ ends: every later AcceleratorState() copies the process state's type
                # over its own, and save_state/load_state would read MULTI_CPU again
                PartialState._shared_state["distributed_type"] = self.distributed_type

        return init_with_fsdp

    PATCHES.replace(AcceleratorState, "__init__", fsdp_too, why="FSDP2 on the CPU (gloo), as on GPUs",
                    needs=Shape(parameters=("fsdp_plugin",),
                                reads=("distributed_type", "_mixed_precision", "fsdp_plugin")))


def _closing(destroy: Any) -> Any:
    """accelerate's destroy of the default process group, done as cpctl's exit does it."""
    from cpctl.runtime import process

    @functools.wraps(destroy)
    def close(self, group=None):
        return destroy(self, group) if group is not None else process.close_process_group()

    return close


def _check_sizes(built: Any, profile: config.Profile) -> None:
    """The script's ParallelismConfig (None: the Accelerator has none) against the profile: one
    layout, or a clear error naming both."""
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
    strategy = getattr(getattr(built, "cp_handler", None), "cp_comm_strategy", None)
    if parallel.cp_size > 1 and strategy is not None and strategy != parallel.cp_comm_strategy:
        differ.append(f"cp_comm_strategy {strategy} (profile: {parallel.cp_comm_strategy})")
    if differ:
        raise CpctlError(f"the script's ParallelismConfig sets {', '.join(differ)}; set them in one place: "
                         "drop them from the script (ParallelismConfig() reads cpctl's) or pass the same to cpctl launch")


if __name__ == "__main__":
    main(sys.argv[1:])
