"""The `cpctl` command line: presentation only.

Library code raises CpctlError with a message that names the fix; this module prints it on one
line and exits 2 (or the failed worker's own exit code for a launch). torch is imported only
by the commands that need it (`launch` without --dry-run, `check` without --static, `env`),
so `--help`, `--version` and `launch --dry-run` answer in a fraction of an `import torch`.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import functools
import gc
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cpctl import __version__
from cpctl.config.schema import KEYS, RETIRED, Key
from cpctl.errors import CpctlError, LaunchError
from cpctl.launch import views
from cpctl.launch.failures import machine_host_memory_gib


class _Switches:
    """Help that shows no `<bool>` type after a plain switch (typer prints one, even for --help)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


# click's base of the errors it shows itself, from the click typer runs on (its own copy in recent
# releases), reached through typer's public BadParameter
_CLICK_ERROR = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException")


class _Group(_Switches, typer.core.TyperGroup):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's own errors (an unknown option or command, an option without its value) as one
        `error:` line naming the help to read, exit 2, as every other bad input is; not a boxed block."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _CLICK_ERROR as exc:
            message = " ".join(exc.format_message().split())  # click's may span lines
            where = getattr(getattr(exc, "ctx", None), "command_path", None)
            help_hint = "" if not where else f" See {where} --help." if message.endswith("?") else f"; see {where} --help"
            message = message if message.endswith("?") else message.rstrip(".")
            _stderr().print(f"[bold red]error:[/] {escape(message)}{help_hint}", soft_wrap=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            _stderr().print("Aborted.")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class _Command(_Switches, typer.core.TyperCommand):
    pass


SWITCH = {"metavar": ""}  # typer.Option(...) keywords of a plain on/off switch

def _dashed(name: str) -> str:
    """Option names match with `_` read as `-` (`--num_processes` is `--num-processes`), as
    accelerate launch spells them both ways."""
    return name.replace("_", "-")


app = typer.Typer(
    cls=_Group,
    name="cpctl",
    help="Context parallelism for PyTorch long-sequence training, as one flag.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"token_normalize_func": _dashed},
)


# ----------------------------------------------------------------------------- profile flags
# One place defines the option set of `config`, `launch` and `check`: a `--<key> VALUE` per
# profile key (config.schema.KEYS), parsed and validated by the profile so every bad value
# gets the same one-line error whether it came from a flag, a variable or a file.

PROFILE_FLAGS: tuple[Key, ...] = tuple(spec for spec in KEYS.values() if spec.path != "version")
_PANELS = {"parallelism": "Parallelism", "fsdp": "FSDP", "launch": "Machines", "": "Model"}  # else the section, capitalized


def _param_name(spec: Key) -> str:
    return "flag_" + spec.name


def _flag_parameter(spec: Key) -> inspect.Parameter:
    option = typer.Option(
        spec.flag,
        help=f"{spec.help} ({spec.allowed}; env {spec.env_var})",
        metavar="N" if "integer" in spec.allowed else "VALUE",
        rich_help_panel=_PANELS.get(spec.path.rpartition(".")[0], spec.path.rpartition(".")[0].capitalize()),
        show_default=False,
    )
    return inspect.Parameter(
        _param_name(spec), inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[str | None, option]
    )


def profile_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` one option per profile key; it receives them as `flags={key path: text}`,
    holding only the flags the user gave."""
    signature = inspect.signature(command, eval_str=True)
    own = [param for name, param in signature.parameters.items() if name != "flags"]
    added = [_flag_parameter(spec) for spec in PROFILE_FLAGS]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {spec.path: kwargs.pop(_param_name(spec)) for spec in PROFILE_FLAGS}
        return command(**kwargs, flags={path: text for path, text in given.items() if text is not None})

    parameters = [*own, *added]
    # what typer reads, through inspect.signature (a function declares no __signature__ attribute)
    setattr(wrapper, "__signature__", signature.replace(parameters=parameters))
    wrapper.__annotations__ = {param.name: param.annotation for param in parameters}
    del wrapper.__wrapped__  # typer must see the new signature, not the wrapped one
    return wrapper


def _accelerate_parameter(alias: Any) -> inspect.Parameter:
    panel = "accelerate launch's flags (same meaning)"
    if alias.switch is not None:
        option = typer.Option(alias.name, help=alias.help, rich_help_panel=panel, **SWITCH)
        return inspect.Parameter(alias.param, inspect.Parameter.KEYWORD_ONLY, default=False,
                                 annotation=Annotated[bool, option])
    option = typer.Option(alias.name, help=alias.help, metavar="VALUE", rich_help_panel=panel, show_default=False)
    return inspect.Parameter(alias.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[str | None, option])


def accelerate_launch_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` the flags of `accelerate launch` that cpctl honours (cpctl.launch.accelerate_flags;
    the ones that are cpctl's own flags already, like --mixed-precision, are not added again);
    it receives the given ones as `accelerate={name: text}`. accelerate's underscore spellings
    match through the app's `_dashed`."""
    from cpctl.launch.accelerate_flags import ALIASES

    own_flags = {spec.flag for spec in PROFILE_FLAGS}
    registered = [alias for alias in ALIASES if alias.name not in own_flags]
    signature = inspect.signature(command, eval_str=True)
    own = [param for name, param in signature.parameters.items() if name != "accelerate"]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {}
        for alias in registered:
            value = kwargs.pop(alias.param)
            if value is not None and value is not False:
                given[alias.name] = alias.switch if value is True else value
        return command(**kwargs, accelerate=given)

    parameters = [*own, *(_accelerate_parameter(alias) for alias in registered)]
    # what typer reads, through inspect.signature (a function declares no __signature__ attribute)
    setattr(wrapper, "__signature__", signature.replace(parameters=parameters))
    wrapper.__annotations__ = {param.name: param.annotation for param in parameters}
    del wrapper.__wrapped__
    return wrapper


# ----------------------------------------------------------------------------- presentation


def _stdout() -> Console:
    return Console(highlight=False)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """CpctlError -> one rich line on stderr and exit 2 (a launch's own code if it has one)."""
    try:
        yield
    except CpctlError as exc:
        _stderr().print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(exc.exit_code if isinstance(exc, LaunchError) else 2) from None


def _suggest_flag(text: str) -> str:
    from cpctl.launch.accelerate_flags import ALIASES

    known = [spec.flag for spec in PROFILE_FLAGS] + ["--config", "--profile", "--dry-run", "--module"]
    known += [alias.name for alias in ALIASES if alias.name not in known]
    name = text.split("=")[0]
    retired = next((key for key in RETIRED.values() if key.flag == name), None)
    if retired is not None:
        return f": a retired key; {retired.reason}; drop the flag"
    # an abbreviation (`--nproc`) means the option it starts; else the closest spelling
    started = [flag for flag in known if flag.startswith(name)] if len(name) > 3 else []
    close = started[:1] if len(started) == 1 else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else "; see cpctl launch --help"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"cpctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Show the version and exit.", is_eager=True, callback=_show_version, **SWITCH)
    ] = False,
) -> None:
    """Context parallelism for PyTorch long-sequence training, as one flag."""


ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Profile YAML file.", show_default=False, rich_help_panel="Profile")
]
ProfileOption = Annotated[
    str | None,
    typer.Option(
        "--profile", "-p", help="Named profile: ./configs/NAME.yaml, the user config dir, or one shipped with cpctl.",
        show_default=False, rich_help_panel="Profile",
    ),
]

# ----------------------------------------------------------------------------- commands


@app.command(cls=_Command)
@profile_flags
def config(
    *,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the profile.")] = Path("cpctl.yaml"),
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Take defaults and flags without asking (also when there is no TTY).", **SWITCH)] = False,
    from_accelerate: Annotated[Path | None, typer.Option("--from-accelerate", help="Preset the answers from the config file `accelerate config` wrote (flags still win).", show_default=False)] = None,
    flags: dict[str, str],
) -> None:
    """Write a profile with an interactive wizard (questionary). Flags preset answers."""
    from cpctl.launch import wizard  # questionary is imported by the wizard only

    with user_errors():
        presets = _accelerate_answers(from_accelerate) if from_accelerate is not None else {}
        code = wizard.run_config(output=output, assume_yes=yes, flags=flags, console=_stdout(), presets=presets,
                                 presets_source=f"--from-accelerate {from_accelerate}")
    raise typer.Exit(code)


@app.command(
    cls=_Command,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
@accelerate_launch_flags
@profile_flags
def launch(
    *,
    script: Annotated[str | None, typer.Argument(metavar="SCRIPT", help="Training script (a module name with -m).", show_default=False)] = None,
    args: Annotated[list[str] | None, typer.Argument(metavar="ARGS", help="The script's arguments, passed to it unchanged.", show_default=False)] = None,
    module: Annotated[bool, typer.Option("--module", "-m", help="SCRIPT is a module name, run as `python -m`.", **SWITCH)] = False,
    config: ConfigOption = None,
    profile: ProfileOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved profile, mesh layout and worker command; spawn nothing.", **SWITCH)] = False,
    flags: dict[str, str],
    accelerate: dict[str, str],
) -> None:
    """Validate the profile, then start the workers with torchrun (PyTorch's elastic agent).

    cpctl's options go before SCRIPT; everything after SCRIPT is the script's, passed to it
    unchanged (as torchrun, accelerate launch and python do). `accelerate launch`'s flags for
    what cpctl has are accepted with accelerate's meaning.
    """
    from cpctl.launch import accelerate_flags, launcher, script_api
    from cpctl.config import merge_layers, preview, resolve

    with user_errors():
        if script is None:
            raise CpctlError("no script given; usage: cpctl launch [OPTIONS] SCRIPT [ARGS]... or cpctl launch -m MODULE [ARGS]...")
        if script.startswith("-"):  # an unknown option lands here, before any script
            raise CpctlError(accelerate_flags.refusal(script) or f"{script}: unknown option{_suggest_flag(script)}")
        script_args = list(args or [])

        def nnodes_of(given_flags: dict[str, str]) -> int:
            return merge_layers(flags=given_flags, config=config, profile_name=profile)[0].get("launch.nnodes", 1)

        all_flags = accelerate_flags.profile_flags(accelerate, flags=flags, nnodes_of=nnodes_of)
        use = script_api.detect(script, module=module, cwd=Path.cwd())
        _note_own_options_after(script, script_args, use)
        given = dict(flags=all_flags, config=config, profile_name=profile, script=use)
        if dry_run:  # shown as on the profile's own machine, whatever this one has
            shown = preview(**given)
            plan = launcher.prepare(shown.resolved, target=script, target_args=script_args, module=module)
            _note_api_disagrees(shown.resolved.profile, use)
            views.print_launch_plan(plan, target=shown.target, problem_here=shown.problem_here,
                                    notes=accelerate_flags.nothing_to_set(accelerate))
            return
        resolved = resolve(**given)
        plan = launcher.prepare(resolved, target=script, target_args=script_args, module=module)
        _note_api_disagrees(resolved.profile, use)
        views.note_without_cp(resolved.profile)
        views.note_more_processes_than_cores(resolved.profile, cores=os.cpu_count())
        launcher.require_devices(resolved.profile)  # a refusal is then the only line
        _stderr().print(f"cpctl: training in {escape(views.precision(resolved))}", soft_wrap=True, highlight=False)
        # Once the workers are done this process has nothing left to finalize: it ends without the
        # interpreter's last garbage collections, which torch's modules make cost 0.7 s a launch.
        atexit.register(gc.freeze)
        launcher.launch(plan)


def _note_api_disagrees(profile: Any, use: Any) -> None:
    """launch.script_api set by hand against what the script's source shows: say so first."""
    from cpctl.launch.script_api import disagreement

    ranks = profile.parallelism.cp_size * profile.parallelism.sp_size  # the ranks that split a sequence
    why = None if use is None else disagreement(use, api=profile.launch.script_api, cp_size=ranks)
    if why is not None:
        _stderr().print(f"[yellow]note:[/] {escape(why)}", soft_wrap=True)


def _note_own_options_after(script: str, script_args: list[str], use: Any) -> None:
    """A cpctl option after SCRIPT is the script's; when the script's source never mentions it,
    it most likely was meant for cpctl: say where it goes (the script still gets it)."""
    from cpctl.launch.accelerate_flags import ALIASES

    switches = {"--dry-run"} | {alias.name for alias in ALIASES if alias.switch}
    own = {spec.flag for spec in PROFILE_FLAGS} | {"--config", "--profile"} | switches
    own |= {alias.name for alias in ALIASES}
    mentioned = use.options if use is not None else frozenset()
    meant: list[str] = []
    names: list[str] = []
    for index, arg in enumerate(script_args):
        if arg == "--":  # what follows was written for the script on purpose
            break
        name = arg.split("=", 1)[0]
        if _dashed(name) in own and name not in mentioned:
            value = script_args[index + 1] if "=" not in arg and name not in switches and index + 1 < len(script_args) else None
            meant += [arg] if value is None or value.startswith("-") else [arg, value]
            names.append(name)
    if meant:
        one = len(names) == 1
        _stderr().print(f"[yellow]note:[/] {escape(', '.join(dict.fromkeys(names)))} after {escape(script)} "
                        f"{'goes' if one else 'go'} to the script, which does not mention {'it' if one else 'them'}; "
                        f"cpctl's options go before SCRIPT: cpctl launch {escape(' '.join(meant))} {escape(script)} ...",
                        soft_wrap=True)


def _accelerate_answers(path: Path) -> dict[str, str]:
    """An accelerate config file's settings as the wizard's preset answers (key path -> text)."""
    from cpctl.config import accelerate_file
    from cpctl.config.layers import read_yaml

    tree = read_yaml(path)
    if not accelerate_file.is_accelerate_config(tree):
        raise CpctlError(f"--from-accelerate {path}: not a file `accelerate config` writes (none of "
                         f"{', '.join(accelerate_file.MARKERS[:3])}...); a cpctl profile goes to --config")
    return {key: str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in accelerate_file.values(tree, source=str(path)).items()}


@app.command(cls=_Command)
@profile_flags
def check(
    *,
    config: ConfigOption = None,
    profile: ProfileOption = None,
    static: Annotated[
        bool,
        typer.Option(
            "--static",
            help="Validate the profile as on the machine it is written for (a cuda profile gets the GPUs it asks for); "
            "skip the device and backend probes. For CI on CPU-only boxes.",
            **SWITCH,
        ),
    ] = False,
    flags: dict[str, str],
) -> None:
    """Validate a profile and this environment without launching; exit 0 when all is fine."""
    from cpctl.launch import envinfo

    with user_errors():
        _, checks = envinfo.run_checks(flags=flags, config=config, profile_name=profile, static=static)
    table = Table(title="cpctl check", title_justify="left", show_edge=False)
    table.add_column("check")
    table.add_column("")
    table.add_column("detail", overflow="fold")
    marks = {True: "[green]ok[/]", False: "[bold red]FAIL[/]", None: "[dim]-[/]"}
    for item in checks:
        table.add_row(item.name, marks[item.ok], escape(item.detail))
    _stdout().print(table)
    failed = [item for item in checks if item.ok is False]
    if failed:
        _stderr().print(f"[bold red]error:[/] {escape(failed[0].detail)}", soft_wrap=True)
        raise typer.Exit(2)


@app.command(cls=_Command)
def env() -> None:
    """Versions, devices, backends and the active default profile."""
    from cpctl.launch import envinfo

    devices, backends = envinfo.devices_and_backends()
    sections = [
        ("versions", envinfo.package_versions()),
        ("devices", devices),
        ("backends", backends),
        ("profile", envinfo.profile_context()),
    ]
    table = Table(show_header=False, show_edge=False, title="cpctl env", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_column(overflow="fold")
    for section, rows in sections:
        for index, (name, value) in enumerate(rows):
            table.add_row(section if index == 0 else "", escape(name), escape(value))
        table.add_section()
    _stdout().print(table)


_PLAN = "Plan"
_TIME = "Step time"


def calibrate_this_machine() -> Any:
    """`cpctl plan --calibrate`: this machine's GPU timed and its figures cached; no GPU is one line."""
    from cpctl.planner import calibration, hardware

    import torch

    if not torch.cuda.is_available():
        raise CpctlError("cpctl plan --calibrate times a GPU and this machine has none: run it where you train "
                         "(plans use the built-in H200 figures meanwhile; --gpu h100 for an H100's)")
    figures = calibration.calibrate("cuda")
    path = hardware.save_calibration(figures)
    Console(stderr=True).print(f"calibration kept in {escape(str(path))}; later plans use it (--gpu h200 for the built-in)")
    return figures


@app.command(cls=_Command)
@profile_flags
def plan(
    *,
    seq_len: Annotated[str | None, typer.Option(
        "--seq-len", help="Tokens per sequence: 4096, 128k, 1M.", metavar="TOKENS", show_default=False, rich_help_panel=_PLAN)] = None,
    chunked_loss: Annotated[bool, typer.Option(
        "--chunked-loss", help="The loss is chunked (rt.causal_lm_loss): memory.loss_chunk_tokens tokens of logits "
        "at a time, never the full logits.", rich_help_panel=_PLAN, **SWITCH)] = False,
    model_loss: Annotated[bool, typer.Option(
        "--model-loss", help="The loss is model(labels=...).loss: the loop does not keep the logits through backward.",
        rich_help_panel=_PLAN, **SWITCH)] = False,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", help="What if the world were N GPUs: all of them CP unless --cp-size is given.",
        metavar="N", show_default=False, rich_help_panel=_PLAN)] = None,
    gpu_memory: Annotated[str, typer.Option(
        "--gpu-memory", help="GiB per GPU (141: an H200).", metavar="GIB", rich_help_panel=_PLAN)] = "141",
    host_memory: Annotated[str | None, typer.Option(
        "--host-memory", help="GiB of host memory per machine, for the offload options (default: this machine's; "
        "with --gpus, not checked).",
        metavar="GIB", show_default=False, rich_help_panel=_PLAN)] = None,
    batch: Annotated[str, typer.Option(
        "--batch", help="Sequences per step on each CP group.", metavar="N", rich_help_panel=_PLAN)] = "1",
    lora_rank: Annotated[str | None, typer.Option(
        "--lora-rank", help="LoRA (peft) of this rank: the base frozen, adapters trained (default: full fine-tuning).",
        metavar="R", show_default=False, rich_help_panel=_PLAN)] = None,
    lora_targets: Annotated[str | None, typer.Option(
        "--lora-targets", help="The projections with adapters, as peft's target_modules: all-linear (default: every "
        "projection of attention and the MLP, not the LM head) or a list such as q_proj,v_proj.",
        metavar="NAMES", show_default=False, rich_help_panel=_PLAN)] = None,
    lora_dropout: Annotated[str | None, typer.Option(
        "--lora-dropout", help="peft's lora_dropout (default 0); above 0 each adapter keeps its dropped input and mask.",
        metavar="P", show_default=False, rich_help_panel=_PLAN)] = None,
    base_dtype: Annotated[str | None, typer.Option(
        "--base-dtype", help="The frozen base's dtype under LoRA: bf16, fp16 or fp32 (default: the config.json's "
        "dtype, fp32 if it names none).", metavar="DTYPE", show_default=False, rich_help_panel=_PLAN)] = None,
    document_tokens: Annotated[str | None, typer.Option(
        "--document-tokens", help="Sequences are packed documents of this many tokens: attention's time counts "
        "only the pairs inside a document.", metavar="TOKENS", show_default=False, rich_help_panel=_TIME)] = None,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", help="Whose throughputs time the step: h200, h100 (built in) or calibrated (cpctl plan --calibrate's, "
        "the default when there is one; else h200).", metavar="NAME", show_default=False, rich_help_panel=_TIME)] = None,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this machine's GPU first (about 30 s of matmuls, attention kernels, copies) and "
        "keep its figures for later plans.", rich_help_panel=_TIME, **SWITCH)] = False,
    nvlink_gbps: Annotated[str | None, typer.Option(
        "--nvlink-gbps", help="GB/s per GPU of collectives inside a node (default 370: NVLink 4).", metavar="GB/S",
        show_default=False, rich_help_panel=_TIME)] = None,
    network_gbps: Annotated[str | None, typer.Option(
        "--network-gbps", help="GB/s per GPU of collectives across nodes (default 45: 8 x 400 Gb/s per node of 8).",
        metavar="GB/S", show_default=False, rich_help_panel=_TIME)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.", rich_help_panel=_PLAN, **SWITCH)] = False,
    config: ConfigOption = None,
    profile: ProfileOption = None,
    flags: dict[str, str],
) -> None:
    """Estimate the memory per GPU of a training step, how long it takes, and the longest sequence that fits.

    Prints the peak broken down by term, what to turn on when it does not fit, the step's time by
    kernel class, the layouts that fit ranked by their time, and the longest sequence for 1 to 32
    GPUs. The model is the profile's `model` (--model). Arithmetic only (torch is not imported),
    except with --calibrate, which times this machine's GPU first.
    """
    from cpctl import planner

    with user_errors():
        if calibrate:
            figures = calibrate_this_machine()
            if seq_len is None:
                typer.echo(json.dumps(figures.to_dict(), indent=2)) if json_output else views.print_throughputs(figures)
                return
        if seq_len is None:
            raise CpctlError("--seq-len is required, e.g. --seq-len 128k")
        figures = planner.throughputs_for(gpu).with_links(
            nvlink_gbps=None if nvlink_gbps is None else planner.parse_number(nvlink_gbps, what="--nvlink-gbps",
                                                                              minimum=0.001),
            network_gbps=None if network_gbps is None else planner.parse_number(network_gbps, what="--network-gbps",
                                                                                minimum=0.001))
        documents = None if document_tokens is None else planner.parse_tokens(document_tokens, what="--document-tokens")
        tokens = planner.parse_tokens(seq_len)
        world = None if gpus is None else int(planner.parse_number(gpus, what="--gpus", integer=True))
        memory = planner.parse_number(gpu_memory, what="--gpu-memory", minimum=0.001)
        if host_memory is not None:
            host = planner.parse_number(host_memory, what="--host-memory", minimum=0.001)
        else:  # --gpus plans other machines, whose host memory this one does not know
            host = machine_host_memory_gib() if world is None else None
        sequences = int(planner.parse_number(batch, what="--batch", integer=True))
        lora = planner.parse_lora(rank=lora_rank, targets=lora_targets, dropout=lora_dropout, base_dtype=base_dtype)
        resolved = planner.resolve_setup(flags=flags, config=config, profile_name=profile, gpus=world,
                                         chunked_loss=chunked_loss, logits_kept=not model_loss, batch=sequences,
                                         lora=lora)
        if resolved.model is None:
            raise CpctlError(f"--model is required: a preset ({', '.join(planner.PRESETS)}) or a Hugging Face "
                             "config.json (or model: in the profile)")
        shape = planner.load_model(resolved.model)
        result = planner.make_plan(shape, resolved.setup, tokens, gpu_memory_gib=memory, host_memory_gib=host,
                                   available=planner.available_options(), figures=figures, document_tokens=documents)
    if json_output:
        shown = {"target": resolved.target, "note": resolved.note, "split_by_sp_size_auto": resolved.split}
        typer.echo(json.dumps({**result.to_dict(), "profile": shown}, indent=2))
        return
    views.print_memory_plan(result, resolved)


def main() -> None:
    app(prog_name="cpctl")


if __name__ == "__main__":
    main()
