"""The `cpctl` command line: presentation only.

Library code raises CpctlError with a message that names the fix; this module prints it on one
line and exits 2 (or the failed worker's own exit code for a launch). torch is imported only
by the commands that need it (`launch` without --dry-run, `check` without --static, `env`),
so `--help`, `--version` and `launch --dry-run` answer in a fraction of an `import torch`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cpctl import __version__
from cpctl.config.schema import KEYS, Key
from cpctl.errors import CpctlError
from cpctl.launch import views


class _Switches:
    """Help that shows no `<bool>` type after a plain switch (typer prints one, even for --help)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class _Group(_Switches, typer.core.TyperGroup):
    pass


class _Command(_Switches, typer.core.TyperCommand):
    pass


SWITCH = {"metavar": ""}  # typer.Option(...) keywords of a plain on/off switch

app = typer.Typer(
    cls=_Group,
    name="cpctl",
    help="Context parallelism for PyTorch long-sequence training, as one flag.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {param.name: param.annotation for param in parameters}
    del wrapper.__wrapped__  # typer must see the new signature, not the wrapped one
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
        raise typer.Exit(getattr(exc, "exit_code", 2)) from None


def _suggest_flag(text: str) -> str:
    known = [spec.flag for spec in PROFILE_FLAGS] + ["--config", "--profile", "--dry-run", "--module"]
    name = text.split("=")[0]
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
@profile_flags
def launch(
    *,
    script: Annotated[str | None, typer.Argument(metavar="SCRIPT", help="Training script (a module name with -m).", show_default=False)] = None,
    args: Annotated[list[str] | None, typer.Argument(metavar="ARGS", help="Passed to the script unchanged.", show_default=False)] = None,
    module: Annotated[bool, typer.Option("--module", "-m", help="SCRIPT is a module name, run as `python -m`.", **SWITCH)] = False,
    config: ConfigOption = None,
    profile: ProfileOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved profile, mesh layout and worker command; spawn nothing.", **SWITCH)] = False,
    flags: dict[str, str],
) -> None:
    """Validate the profile, then start the workers with torchrun (PyTorch's elastic agent).

    Profile options and --dry-run may come before or after SCRIPT; every other argument after
    SCRIPT, and everything after `--`, goes to the script.
    """
    from cpctl.config import preview, resolve
    from cpctl.launch import launcher

    with user_errors():
        if script is None:
            raise CpctlError("no script given; usage: cpctl launch [OPTIONS] SCRIPT [ARGS]... or cpctl launch -m MODULE [ARGS]...")
        if script.startswith("-"):  # an unknown option lands here, before any script
            raise CpctlError(f"{script}: unknown option{_suggest_flag(script)}")
        trailing, trailing_dry_run, script_args = split_trailing_options(list(args or []))
        if trailing or trailing_dry_run:
            taken = [spec.flag for spec in PROFILE_FLAGS if spec.path in trailing] + (["--dry-run"] if trailing_dry_run else [])
            _stderr().print(f"[dim]note: {escape(', '.join(taken))} after the script taken as cpctl options; "
                            "script options of the same name go after --[/]", soft_wrap=True)
        given = dict(flags=flags | trailing, config=config, profile_name=profile)
        if dry_run or trailing_dry_run:  # shown as on the profile's own machine, whatever this one has
            shown = preview(**given)
            plan = launcher.prepare(shown.resolved, target=script, target_args=script_args, module=module)
            views.print_launch_plan(plan, target=shown.target, problem_here=shown.problem_here)
            return
        resolved = resolve(**given)
        plan = launcher.prepare(resolved, target=script, target_args=script_args, module=module)
        views.note_without_cp(resolved.profile)
        launcher.launch(plan)


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


@app.command(cls=_Command)
@profile_flags
def plan(
    *,
    model: Annotated[str | None, typer.Option(
        "--model", help="A preset (tiny, 1b, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b) or a Hugging Face config.json "
        "(or its directory).", metavar="NAME|PATH", show_default=False, rich_help_panel=_PLAN)] = None,
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
    batch: Annotated[str, typer.Option(
        "--batch", help="Sequences per step on each CP group.", metavar="N", rich_help_panel=_PLAN)] = "1",
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.", rich_help_panel=_PLAN, **SWITCH)] = False,
    config: ConfigOption = None,
    profile: ProfileOption = None,
    flags: dict[str, str],
) -> None:
    """Estimate the memory per GPU of a training step, and the longest sequence that fits.

    Prints the peak broken down by term, what to turn on when it does not fit, and the longest
    sequence for 1 to 32 GPUs. Arithmetic only: nothing runs, torch is not imported.
    """
    from cpctl import planner

    with user_errors():
        if model is None:
            raise CpctlError(f"--model is required: a preset ({', '.join(planner.PRESETS)}) or a Hugging Face config.json")
        if seq_len is None:
            raise CpctlError("--seq-len is required, e.g. --seq-len 128k")
        shape = planner.load_model(model)
        tokens = planner.parse_tokens(seq_len)
        world = None if gpus is None else int(planner.parse_number(gpus, what="--gpus", integer=True))
        memory = planner.parse_number(gpu_memory, what="--gpu-memory", minimum=0.001)
        sequences = int(planner.parse_number(batch, what="--batch", integer=True))
        resolved = planner.resolve_setup(flags=flags, config=config, profile_name=profile, gpus=world,
                                         chunked_loss=chunked_loss, logits_kept=not model_loss, batch=sequences)
        result = planner.make_plan(shape, resolved.setup, tokens, gpu_memory_gib=memory,
                                   available=planner.available_options())
    if json_output:
        typer.echo(json.dumps({**result.to_dict(), "profile": {"target": resolved.target, "note": resolved.note}},
                              indent=2))
        return
    views.print_memory_plan(result, resolved)


# cpctl options that may also follow SCRIPT (`cpctl launch train.py --cp-size 8` works as written). --config
# and --profile are not among them: scripts often take options of those names.
TRAILING_FLAGS = {spec.flag: spec.path for spec in PROFILE_FLAGS}
TRAILING_SWITCHES = {"--dry-run"}


def split_trailing_options(script_args: list[str]) -> tuple[dict[str, str], bool, list[str]]:
    """cpctl's own options among the arguments after SCRIPT, up to a `--` that ends them.

    Returns (profile flags by key path, whether --dry-run was given, the script's arguments).
    """
    flags: dict[str, str] = {}
    dry_run = False
    rest: list[str] = []
    args = iter(script_args)
    for arg in args:
        if arg == "--":
            rest.extend(args)
            break
        name, has_value, value = arg.partition("=")
        if name in TRAILING_SWITCHES and not has_value:
            dry_run = True
        elif name in TRAILING_FLAGS:
            if not has_value:
                value = next(args, None)
                if value is None:
                    raise CpctlError(f"{name} needs a value, e.g. {name} 2")
            flags[TRAILING_FLAGS[name]] = value
        else:
            rest.append(arg)
    return flags, dry_run, rest


def main() -> None:
    app(prog_name="cpctl")


if __name__ == "__main__":
    main()
