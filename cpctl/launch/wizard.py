"""`cpctl config`: the wizard that asks for a profile, checks every answer, and writes YAML.

The questions, their help and their choices are the keys' own declarations (cpctl/config/
schema.py); this module only orders them. Every answer goes through the key's kind and
through the profile rules that can already be decided from the answers so far (cpctl/config/
rules.py: the sizes must fit the world size, CP needs FSDP2 and SDPA, ...), so a bad answer is
re-asked at once. The final text is resolved with `config.resolve` before it replaces the
output file: the wizard never writes an invalid profile.

`--yes`, or stdin not a terminal, takes the defaults and the flags without asking.
questionary (and prompt_toolkit) are imported only here, and only when a question is asked.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cpctl import config
from cpctl.config import AUTO, KEYS
from cpctl.config.rules import Machine, fill_auto, first_problem, gpus, world_size
from cpctl.errors import CpctlError
from cpctl.launch import views

DEFAULT_OUTPUT = Path(config.LOCAL_PROFILE)
EXIT_WRITTEN, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 130

Answers = dict[str, Any]  # key path -> typed value, only the keys known so far


# ----------------------------------------------------------------------------- rules


def _filled(answers: Answers, machine: Machine) -> tuple[Answers, Machine]:
    """The answers with `auto` resolved as on this machine, and the machine to check against:
    a cuda profile written where no GPU is visible is for another machine, with the GPUs it asks."""
    if answers.get("launch.device") == "cuda" and machine.cuda_devices == 0:
        nproc = answers.get("launch.nproc_per_node")
        machine = Machine(cuda_devices=nproc if isinstance(nproc, int) else 0)
    return fill_auto(answers, machine=machine)[0], machine


def cross_check(answers: Answers, *, machine: Machine) -> str | None:
    """The first profile rule the answers known so far already break, as a message; else None.

    The wizard and `resolve` share the rules (config.rules), so a mistake reads the same in
    `cpctl config` as in `cpctl launch`; a rule waits until all of its keys are answered.
    """
    try:
        filled, target = _filled(answers, machine)
    except CpctlError as exc:  # a model that cannot be read, for sp_size auto
        return str(exc)
    return first_problem(filled, machine=target)


def check_value(path: str, value: Any, *, answers: Answers, machine: Machine) -> str | None:
    """Why `value` cannot be the answer for `path` given the other answers; None if it can."""
    spec = KEYS[path]
    if not spec.check(value):
        return f"{value!r} is not allowed for {spec.leaf}; expected {spec.allowed}"
    return cross_check({**answers, path: value}, machine=machine)


def parse_answer(path: str, text: str, *, answers: Answers, machine: Machine) -> tuple[Any, str | None]:
    """A typed answer from typed-in text, and the reason it is refused (None if accepted)."""
    spec = KEYS[path]
    try:
        value = spec.spec.kind.parse(text)
    except ValueError:
        what = "an empty answer" if not text.strip() else repr(text)
        return None, f"{what} is not allowed for {spec.leaf}; expected {spec.allowed}"
    return value, check_value(path, value, answers=answers, machine=machine)


def _first_fitting(path: str, candidates: list[Any], *, answers: Answers, machine: Machine) -> Any:
    """The first candidate the rules accept (else the first: the final check then says why)."""
    for value in candidates:
        if check_value(path, value, answers=answers, machine=machine) is None:
            return value
    return candidates[0] if candidates else None


# ----------------------------------------------------------------------------- asking


def _wrap_refusals(question: Any) -> None:
    """Show why an answer is refused in full, word-wrapped over as many lines as it needs.

    prompt_toolkit's validation toolbar is one line: a reason longer than the terminal is cut
    (`... or change --n`), and the cut part is usually the fix. The prompt's layout keeps that
    toolbar as the container shown while the buffer has a validation error; its content is
    replaced by a window that wraps. A layout without it (another prompt_toolkit) is left as it is.
    """
    from prompt_toolkit.application import get_app
    from prompt_toolkit.filters import has_validation_error
    from prompt_toolkit.layout import ConditionalContainer, FormattedTextControl, Window

    def reason() -> list[tuple[str, str]]:
        app = get_app()
        error = app.current_buffer.validation_error
        if error is None:
            return []
        # flags such as --nproc-per-node stay whole on one line, as they are typed
        lines = textwrap.wrap(error.message, max(app.output.get_size().columns, 1), break_on_hyphens=False)
        return [("class:validation-toolbar", "\n".join(lines))]

    for container in question.application.layout.walk():
        if isinstance(container, ConditionalContainer) and container.filter is has_validation_error:
            container.content = Window(FormattedTextControl(reason), dont_extend_height=True)
            return


class _Asker:
    """Asks one key at a time: skips flagged keys, takes defaults when not interactive."""

    def __init__(self, *, answers: Answers, machine: Machine, interactive: bool):
        self.answers = answers
        self.machine = machine
        self.interactive = interactive
        self.origins = {path: f"flag {KEYS[path].flag}" for path in answers}  # where each answer came from
        self.q: Any = None
        if interactive:
            import questionary  # here only: `cpctl --help` stays fast

            self.q = questionary

    def text(self, path: str, hint: str = "", *, default: Any, why: str | None = None) -> None:
        if self._settled(path, default, why):
            return
        message = KEYS[path].spec.prompt + (f" ({hint})" if hint else "")

        def validate(text: str) -> bool | str:
            return parse_answer(path, text, answers=self.answers, machine=self.machine)[1] or True

        shown = "" if default is None else str(default)
        question = self.q.text(message, default=shown, validate=validate)
        _wrap_refusals(question)
        text = question.unsafe_ask()
        self.answers[path] = parse_answer(path, text, answers=self.answers, machine=self.machine)[0]
        self.origins[path] = "answer"

    def select(self, path: str, *, default: Any, extra: Mapping[Any, str] | None = None) -> None:
        if self._settled(path, default):
            return
        message, choices = KEYS[path].spec.prompt, {**(extra or {}), **KEYS[path].spec.choices}
        # A select cannot re-ask: it offers only the choices the answers so far allow.
        allowed = [value for value in choices
                   if check_value(path, value, answers=self.answers, machine=self.machine) is None] or list(choices)
        options = [self.q.Choice(title=choices[value], value=value) for value in allowed]
        default = default if default in allowed else allowed[0]
        self.answers[path] = self.q.select(message, choices=options, default=default).unsafe_ask()
        self.origins[path] = "answer"

    def confirm(self, path: str, *, default: bool) -> None:
        if self._settled(path, default):
            return
        self.answers[path] = self.q.confirm(KEYS[path].spec.prompt, default=default).unsafe_ask()
        self.origins[path] = "answer"

    def gate(self, message: str, *, default: bool) -> bool:
        """A yes/no that only decides which questions follow (no key of its own)."""
        if not self.interactive:
            return default
        return bool(self.q.confirm(message, default=default).unsafe_ask())

    def ask(self, path: str) -> None:
        """A key with no question of its own in the order below: by its kind, from its declaration."""
        spec = KEYS[path].spec
        if spec.choices:
            self.select(path, default=spec.default)
        elif isinstance(spec.default, bool):
            self.confirm(path, default=spec.default)
        else:
            self.text(path, default=spec.default)

    def _settled(self, path: str, default: Any, why: str | None = None) -> bool:
        """True when `path` needs no question: given as a flag, or (not interactive) its default.

        Without questions, defaults are taken as they are; the whole is checked at the end, so
        a conflict is blamed on the flags that cause it, not on a default asked first.
        """
        if path in self.answers:
            return True
        if self.interactive:
            return False
        self.answers[path] = default
        declared = KEYS[path].default
        self.origins[path] = "default" if default == declared else (why or "chosen to fit the other values")
        return True


MEMORY_OPTIONS = ("memory.loss_chunk_tokens", "memory.tiled_mlp_tokens", "memory.tiled_norm_tokens",
                  "memory.offload_activations", "memory.cpu_offload")  # asked behind one yes/no: most profiles need none of them


def _ask_all(ask: _Asker) -> None:
    """The questions, in the order the command documents; each default fits the answers before it.

    Keys declared with a question but not placed here are asked last, by their kind, so a new
    key reaches the wizard with its declaration alone.
    """
    answers, machine = ask.answers, ask.machine
    ask.select("launch.script_api", default=AUTO)
    here = f"cuda here, {gpus(machine.cuda_devices)} visible" if machine.cuda_devices else "cpu here, no GPU visible"
    ask.select("launch.device", default=AUTO, extra={AUTO: f"auto  cuda if a GPU is visible ({here})"})

    ask.text("launch.nnodes", default=1)
    if answers["launch.nnodes"] > 1:  # no node_rank: each machine gives its own at launch (launch_command)
        ask.text("launch.rdzv_endpoint", default=None)

    # auto first: the profile then takes the process count of the machine it runs on (a count
    # written here would hold elsewhere too); a count only where the sizes given need one
    device = _filled(answers, machine)[0]["launch.device"]
    if device == "cuda" and machine.cuda_devices == 0:
        nproc_candidates: list[Any] = [AUTO]  # a profile for another machine: no count to guess
        hint, fitting = "GPUs per machine; none visible here", "auto"
    elif device == "cuda":
        nproc_candidates = [AUTO, *range(machine.cuda_devices, 0, -1)]
        hint, fitting = f"auto = the {gpus(machine.cuda_devices)} visible", "else the most GPUs"
    else:
        nproc_candidates = [AUTO, *range(config.CPU_DEFAULT_NPROC, 65), 1]
        hint, fitting = f"auto = {config.CPU_DEFAULT_NPROC} on cpu", "else the fewest processes"
    ask.text("launch.nproc_per_node", hint,
             default=_first_fitting("launch.nproc_per_node", nproc_candidates, answers=answers, machine=machine),
             why=f"auto if it fits the sizes given, {fitting} per machine that do")

    filled = _filled(answers, machine)[0]
    world, nproc = world_size(filled), filled["launch.nproc_per_node"]
    # The declared default (1, no CP) as everywhere else; the question says how far CP can go here.
    most = f"up to {nproc} on one machine" if isinstance(nproc, int) else "up to the processes per machine"
    ask.text("parallelism.cp_size", f"1 = no context parallelism, {most}; world size {world}",
             default=KEYS["parallelism.cp_size"].default)
    ask.text("parallelism.sp_size", "1 = no Ulysses; it must divide the model's attention heads; auto = cpctl splits "
             "the cp_size ranks into Ulysses x ring from the model", default=KEYS["parallelism.sp_size"].default)
    if answers["parallelism.sp_size"] == AUTO:  # the one question that needs the model
        ask.text("model", "e.g. llama-3.1-8b, or path/to/config.json", default=None)
    ask.text("parallelism.tp_size", default=1)
    ask.text("parallelism.dp_replicate_size", default=1)
    sp = answers["parallelism.sp_size"]  # auto: its ranks are among cp_size's
    others = (answers["parallelism.dp_replicate_size"] * answers["parallelism.cp_size"] * (1 if sp == AUTO else sp)
              * answers["parallelism.tp_size"])
    shards = world // others if world and world % others == 0 else None
    # auto, not the number it comes to: a profile saved from the defaults still fits a launch
    # with another process count (cpctl plan --nproc-per-node 1, a machine with fewer GPUs).
    ask.text("parallelism.dp_shard_size", f"auto = world {world} / (dp_replicate * cp * sp * tp)"
             + ("" if shards is None else f" = {shards}"), default=AUTO, why=f"world {world} / (dp_replicate * cp * sp * tp)")

    if answers["parallelism.cp_size"] > 1:  # meaningless without CP: not asked, not written
        ask.select("parallelism.cp_comm_strategy", default="allgather")
        ask.confirm("parallelism.cp_load_balance", default=True)
        if answers["launch.script_api"] == "accelerate":
            ask.select("parallelism.cp_engine", default="cpctl")
    ask.select("fsdp.mixed_precision", default=AUTO)
    ask.confirm("fsdp.activation_checkpointing", default=False)
    if answers["fsdp.activation_checkpointing"]:  # a level of nothing otherwise
        ask.select("memory.checkpoint_level", default="full")
        if answers["memory.checkpoint_level"] == "mixed":
            ask.text("memory.selective_blocks", default=KEYS["memory.selective_blocks"].default)
    if ask.gate("Long sequences: set the memory options (loss chunks, tiled MLP and norms, offload)?", default=False):
        ask.text("memory.loss_chunk_tokens", default=KEYS["memory.loss_chunk_tokens"].default)
        ask.text("memory.tiled_mlp_tokens", "0 = off", default=0)
        ask.text("memory.tiled_norm_tokens", "0 = off", default=0)
        if _filled(answers, machine)[0]["launch.device"] == "cuda":  # both move GPU memory to the host
            if answers["fsdp.activation_checkpointing"]:
                ask.confirm("memory.offload_activations", default=False)
            ask.confirm("memory.cpu_offload", default=False)
    placed = set(answers) | {"model", "launch.rdzv_endpoint", "parallelism.cp_comm_strategy",
                             "parallelism.cp_load_balance", "memory.checkpoint_level", "memory.selective_blocks",
                             "parallelism.cp_engine",
                             *MEMORY_OPTIONS}
    for path, spec in KEYS.items():
        if spec.spec.prompt and path not in placed:
            ask.ask(path)


# ----------------------------------------------------------------------------- output


def profile_yaml(answers: Answers, *, output: Path, split: str | None = None) -> str:
    """The profile file: a header comment (with `split`: what sp_size auto chose as written),
    then the answered keys in schema order."""
    tree = config.to_tree({"version": config.PROFILE_VERSION, **answers})
    nnodes = answers.get("launch.nnodes", 1)
    header = (
        "# cpctl profile written by `cpctl config`; check it with `cpctl check --config FILE`.\n"
        f"# Launch{_on_every_machine(nnodes, endpoint=answers.get('launch.rdzv_endpoint'))}: "
        f"{launch_command(output, nnodes=nnodes)}\n"
    )
    if split:
        header += f"# {split} (decided again at each launch)\n"
    return header + config.to_yaml(tree)


def launch_command(output: Path, *, nnodes: int = 1) -> str:
    node_rank = " --node-rank R" if nnodes > 1 else ""  # each machine its own: see _on_every_machine
    return f"cpctl launch --config {shlex.quote(str(output))}{node_rank} your_script.py"


def _on_every_machine(nnodes: int, *, endpoint: str | None) -> str:
    """Several machines each run the command with their own node rank: node rank 0 hosts the
    rendezvous and runs global rank 0 (launch/rendezvous.py places each machine by its node rank)."""
    if nnodes == 1:
        return ""
    return (f" on each of the {nnodes} machines, R its node rank (0 on the one at {endpoint}: it hosts the rendezvous "
            "and runs global rank 0)")


def _validated(text: str, *, answers: Answers, machine: Machine, given: Mapping[str, str]) -> config.Resolved:
    """Resolve exactly `text` as a profile, apart from any env var or other profile file.
    A problem names the flags given, since without questions they are what decided it."""
    machine = _filled(answers, machine)[1]  # a cuda profile written away from its GPUs: checked as on them
    with tempfile.TemporaryDirectory(prefix="cpctl-config-") as empty:
        candidate = Path(empty) / "candidate.yaml"
        candidate.write_text(text, encoding="utf-8")
        isolated = {"XDG_CONFIG_HOME": empty, "HOME": empty}
        try:
            return config.resolve(config=candidate, environ=isolated, cwd=empty, machine=machine)
        except CpctlError as exc:
            if not given:
                raise
            flags = " ".join(f"{KEYS[p].flag} {t}" for p, t in given.items())
            raise CpctlError(f"flags {flags}: {exc}") from None


def _taken(output: Path) -> bool:
    """Whether writing `output` would replace something: a file, or a link, even to nothing."""
    return output.exists() or output.is_symlink()


def _write(output: Path, text: str) -> None:
    """Replace `output` in one step, so an interrupted write leaves no half file."""
    try:
        _replace(output, text)
    except OSError as exc:
        raise CpctlError(f"--output {output}: cannot write it ({exc.strerror or exc}); choose another path") from None


def _replace(output: Path, text: str) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{output.name}.cpctl-partial."
    for stale in output.parent.glob(prefix + "*"):  # left by a run killed between write and rename
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=output.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a profile is an ordinary file
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _shown(value: Any) -> str:
    """A value as it reads in the YAML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def summary_table(answers: Answers, origins: Mapping[str, str], resolved: config.Resolved, *,
                  output: Path) -> Table:
    table = Table(title=f"cpctl profile: {output}", title_justify="left")
    table.add_column("key", style="cyan")
    table.add_column("value")
    table.add_column("from")
    for path in KEYS:
        if path in answers and path != "version":
            value, final = answers[path], resolved.profile.get(path)
            table.add_row(path, _shown(value) + (f" (here: {_shown(final)})" if value != final else ""),
                          origins.get(path, ""))
    return table


# ----------------------------------------------------------------------------- entry point


def _flag_answers(flags: Mapping[str, str], machine: Machine) -> Answers:
    unknown = [path for path in flags if path not in KEYS]
    if unknown:
        raise CpctlError(f"{unknown[0]}: unknown profile key")
    answers = dict(config.layers.flag_layer(flags).values)
    error = cross_check(answers, machine=machine)
    if error is not None:
        given = " ".join(f"{KEYS[p].flag} {t}" for p, t in flags.items())
        raise CpctlError(f"flags {given}: {error}")
    return answers


def run_config(
    *,
    output: Path,
    assume_yes: bool,
    flags: dict[str, str],
    console: Console,
    interactive: bool | None = None,
    machine: Machine | None = None,
    presets: Mapping[str, str] | None = None,
    presets_source: str = "",
) -> int:
    """`cpctl config`: ask (or take defaults and flags), validate, write `output`, summarise.

    Returns the exit code: 0 written, 1 overwrite declined or input ended, 130 on Ctrl-C.
    Raises CpctlError for a bad flag, an existing file under --yes, or an invalid profile.
    `interactive` defaults to "stdin is a terminal"; `machine` to the GPUs visible here.
    """
    output = Path(output)
    machine = config.detect_machine() if machine is None else machine
    interactive = (sys.stdin.isatty() if interactive is None else interactive) and not assume_yes
    if "launch.node_rank" in flags:
        raise CpctlError(f"{KEYS['launch.node_rank'].flag}: a profile is shared by every machine, and each machine "
                         f"has its own node rank; give it at launch: {launch_command(output, nnodes=2)}")
    # answers from a file (an accelerate config), below the flags; its machine_rank is that machine's alone
    presets = {path: text for path, text in (presets or {}).items() if path != "launch.node_rank"}
    answers = _flag_answers({**presets, **flags}, machine)
    if output.is_dir():
        raise CpctlError(f"--output {output} is a directory; pass a file path such as {output / DEFAULT_OUTPUT}")
    existed = _taken(output)
    if existed and not interactive:
        raise CpctlError(f"{output} already exists; pass a new --output or delete the file (cpctl config never overwrites it unasked)")

    ask = _Asker(answers=answers, machine=machine, interactive=interactive)
    ask.origins.update({path: presets_source for path in presets if path not in flags})
    try:
        if interactive:
            if _taken(output) and not ask.q.confirm(f"{output} exists. Overwrite it?", default=False).unsafe_ask():
                console.print(Text(f"Kept {output}; nothing written. Pass --output to write elsewhere."))
                return EXIT_ABORTED
            console.print("Answers are checked as you go; Enter keeps the shown default.")
            if flags:
                console.print(Text("From flags: " + ", ".join(f"{p} = {_shown(answers[p])}" for p in flags)))
        _ask_all(ask)
    except KeyboardInterrupt:
        console.print("Interrupted; nothing written.")
        return EXIT_INTERRUPTED
    except EOFError:
        console.print("Input ended; nothing written.")
        return EXIT_ABORTED

    resolved = _validated(profile_yaml(answers, output=output), answers=answers, machine=machine,
                          given=flags if not interactive else {})
    split = views.auto_split(resolved)
    text = profile_yaml(answers, output=output, split=split)
    if _taken(output) and not existed:  # created while the questions were open: not ours to replace
        raise CpctlError(f"{output} appeared while the wizard was open; nothing written: run cpctl config again "
                         "to decide about it, or pass another --output")
    _write(output, text)
    console.print(summary_table(answers, ask.origins, resolved, output=output))
    if split:
        console.print(Text(split))
    nnodes = resolved.profile.launch.nnodes
    where = _on_every_machine(nnodes, endpoint=resolved.profile.launch.rdzv_endpoint)
    console.print(Text(f"Wrote {output}. Launch{where or ' with'}:"))
    console.print(Text("  " + launch_command(output, nnodes=nnodes), style="bold"))
    return EXIT_WRITTEN
