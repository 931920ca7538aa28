"""`cpctl config`: the wizard that asks for a profile, checks every answer, and writes YAML.

Every answer goes through the profile schema (`FieldSpec.parse_text` / `check` in
cpctl/profile.py) and through the cross-key rules that can already be decided from the answers
so far (the sizes must divide the world size, CP needs FSDP2 and SDPA, ...), so a bad answer is
re-asked at once. The final text is loaded back with `profile.load_file` and resolved with
`profile.resolve` before it replaces the output file: the wizard never writes an invalid profile.

`--yes`, or stdin not a terminal, takes the defaults and the flags without asking.
questionary (and prompt_toolkit) are imported only here, and only when a question is asked.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cpctl import profile as prof
from cpctl.errors import CpctlError

DEFAULT_OUTPUT = Path(prof.LOCAL_PROFILE)
EXIT_WRITTEN, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 130

# The four mesh axes whose sizes multiply to the world size, with the names errors use.
AXES = {
    "parallelism.dp_replicate_size": "dp_replicate",
    "parallelism.dp_shard_size": "dp_shard",
    "parallelism.cp_size": "cp",
    "parallelism.tp_size": "tp",
}

DEVICE_CHOICES = {
    "cuda": "cuda  NVIDIA GPUs, NCCL",
    "cpu": "cpu   CPU processes, gloo (to try CP out on a laptop or in CI)",
}
STRATEGY_CHOICES = {
    "allgather": "allgather  gather all K/V once: fewest messages, more memory",
    "alltoall": "alltoall   ring rotation of K/V blocks: overlaps with compute, constant memory",
}
PRECISION_CHOICES = {
    "auto": "auto  bf16 on cuda, no on cpu",
    "bf16": "bf16  bfloat16 compute (Ampere or newer GPUs)",
    "fp16": "fp16  float16 compute (older GPUs)",
    "no": "no    full fp32",
}

Answers = dict[str, Any]  # key path -> typed value, only the keys known so far


# ----------------------------------------------------------------------------- rules


def _device(answers: Answers, machine: prof.Machine) -> str | None:
    device = answers.get("launch.device")
    if device == prof.AUTO:
        return "cuda" if machine.cuda_devices > 0 else "cpu"
    return device


def _nproc(answers: Answers, machine: prof.Machine) -> int | None:
    """nproc_per_node as a number, `auto` resolved on this machine; None while unknown."""
    nproc = answers.get("launch.nproc_per_node")
    if nproc != prof.AUTO:
        return nproc
    device = _device(answers, machine)
    if device is None:
        return None
    return machine.cuda_devices if device == "cuda" else prof.CPU_DEFAULT_NPROC


def _world(answers: Answers, machine: prof.Machine) -> int | None:
    nproc, nnodes = _nproc(answers, machine), answers.get("launch.nnodes")
    return nnodes * nproc if nproc and nnodes else None


def cross_check(answers: Answers, *, machine: prof.Machine) -> str | None:
    """The first cross-key rule the answers known so far already break, as a message; else None.

    Unknown keys may still take any value, so a rule is only applied once all of its keys are
    known (the size product: once the world and some sizes are known, their product must
    divide the world; once all four are known, it must equal it).
    """
    device, nnodes = _device(answers, machine), answers.get("launch.nnodes")
    nproc = answers.get("launch.nproc_per_node")
    if device == "cuda" and nproc == prof.AUTO and machine.cuda_devices == 0:
        return "nproc_per_node auto counts visible GPUs and none is visible here; enter the GPUs per machine"
    if device == "cuda" and machine.cuda_devices > 0 and isinstance(nproc, int) and nproc > machine.cuda_devices:
        return f"{nproc} processes per machine but {machine.cuda_devices} GPUs visible; use {machine.cuda_devices} or fewer (or device cpu)"

    known = {name: answers[path] for path, name in AXES.items() if answers.get(path, prof.AUTO) != prof.AUTO}
    product = 1
    for size in known.values():
        product *= size
    factors = " * ".join(f"{name}({size})" for name, size in known.items())
    world = _world(answers, machine)
    if world is not None and known:
        where = f"world size {world} (nnodes {nnodes} x nproc_per_node {_nproc(answers, machine)})"
        if len(known) == len(AXES) and product != world:
            others = product // known["dp_shard"]
            fix = f"; dp_shard {world // others} fits" if world % others == 0 else ""
            return f"{factors} = {product} != {where}{fix}"
        if world % product:
            return f"{factors} = {product} does not divide {where}"
    elif len(known) == len(AXES) and nnodes and product % nnodes:
        return f"{factors} = {product} cannot be split over nnodes {nnodes} machines"

    cp = answers.get("parallelism.cp_size", 1)
    if cp > 1 and answers.get("fsdp.version", 2) != 2:
        return f"cp_size {cp} needs fsdp.version 2 (set to {answers['fsdp.version']}); use cp_size 1 or FSDP2"
    if cp > 1 and answers.get("attention", "sdpa") != "sdpa":
        return f"cp_size {cp} needs attention sdpa (set to {answers['attention']}); use cp_size 1 or sdpa"
    node_rank = answers.get("launch.node_rank")
    if nnodes is not None and node_rank is not None and node_rank >= nnodes:
        return f"node_rank {node_rank} must be below nnodes ({nnodes}): 0..{nnodes - 1}"
    if nnodes and nnodes > 1 and "launch.rdzv_endpoint" in answers and answers["launch.rdzv_endpoint"] is None:
        return (f"{nnodes} machines need a rendezvous endpoint (--rdzv-endpoint): "
                "host:port of the node_rank-0 machine, e.g. node0:29500")
    return None


def check_value(path: str, value: Any, *, answers: Answers, machine: prof.Machine) -> str | None:
    """Why `value` cannot be the answer for `path` given the other answers; None if it can."""
    spec = prof.FIELDS[path]
    if not spec.check(value):
        return f"{value!r} is not allowed for {spec.leaf}; expected {spec.allowed}"
    return cross_check({**answers, path: value}, machine=machine)


def parse_answer(path: str, text: str, *, answers: Answers, machine: prof.Machine) -> tuple[Any, str | None]:
    """A typed answer from typed-in text, and the reason it is refused (None if accepted)."""
    spec = prof.FIELDS[path]
    try:
        value = spec.parse_text(text)
    except ValueError:
        what = "an empty answer" if not text.strip() else repr(text)
        return None, f"{what} is not allowed for {spec.leaf}; expected {spec.allowed}"
    return value, check_value(path, value, answers=answers, machine=machine)


def _first_fitting(path: str, candidates: list[Any], *, answers: Answers, machine: prof.Machine) -> Any:
    """The first candidate the rules accept (else the first: its error is then shown)."""
    for value in candidates:
        if check_value(path, value, answers=answers, machine=machine) is None:
            return value
    return candidates[0] if candidates else None


# ----------------------------------------------------------------------------- asking


class _Asker:
    """Asks one key at a time: skips flagged keys, takes defaults when not interactive."""

    def __init__(self, *, answers: Answers, machine: prof.Machine, interactive: bool):
        self.answers = answers
        self.machine = machine
        self.interactive = interactive
        self.q: Any = None
        if interactive:
            import questionary  # here only: `cpctl --help` stays fast

            self.q = questionary

    def text(self, path: str, message: str, *, default: Any, missing: str | None = None) -> None:
        if self._settled(path, default, missing):
            return

        def validate(text: str) -> bool | str:
            return parse_answer(path, text, answers=self.answers, machine=self.machine)[1] or True

        shown = "" if default is None else str(default)
        text = self.q.text(message, default=shown, validate=validate).unsafe_ask()
        self.answers[path] = parse_answer(path, text, answers=self.answers, machine=self.machine)[0]

    def select(self, path: str, message: str, *, choices: Mapping[Any, str], default: Any) -> None:
        if self._settled(path, default):
            return
        # A select cannot re-ask: it offers only the choices the answers so far allow.
        allowed = [value for value in choices
                   if check_value(path, value, answers=self.answers, machine=self.machine) is None] or list(choices)
        options = [self.q.Choice(title=choices[value], value=value) for value in allowed]
        default = default if default in allowed else allowed[0]
        self.answers[path] = self.q.select(message, choices=options, default=default).unsafe_ask()

    def confirm(self, path: str, message: str, *, default: bool) -> None:
        if self._settled(path, default):
            return
        self.answers[path] = self.q.confirm(message, default=default).unsafe_ask()

    def _settled(self, path: str, default: Any, missing: str | None = None) -> bool:
        """True when `path` needs no question: given as a flag, or taken from its default."""
        if path in self.answers:
            return True
        if self.interactive:
            return False
        error = check_value(path, default, answers=self.answers, machine=self.machine)
        if error is not None:
            if default is None and missing:
                raise CpctlError(f"{path}: {missing}")
            flag = prof.FIELDS[path].flag
            hint = "" if flag in error else f"; pass {flag} or change the other flags"
            raise CpctlError(f"{path} (default {_shown(default)}): {error}{hint}")
        self.answers[path] = default
        return True


def _ask_all(ask: _Asker) -> None:
    """The questions, in the order of SPEC section 2; each default fits the answers before it."""
    answers, machine = ask.answers, ask.machine
    here = f"cuda here, {machine.cuda_devices} GPUs visible" if machine.cuda_devices else "cpu here, no GPU visible"
    ask.select("launch.device", "Device", default=prof.AUTO,
               choices={prof.AUTO: f"auto  cuda if a GPU is visible ({here})", **DEVICE_CHOICES})

    ask.text("launch.nnodes", "Machines (nnodes)", default=1)
    if answers["launch.nnodes"] > 1:
        ask.text("launch.node_rank", "This machine's node_rank (0 on the machine that hosts the rendezvous)", default=0)
        ask.text("launch.rdzv_endpoint", "Rendezvous endpoint, host:port of the node_rank-0 machine",
                 default=None)

    device = _device(answers, machine)
    if device == "cuda" and machine.cuda_devices == 0:
        nproc_candidates: list[Any] = []  # a profile for another machine: no count to guess
        hint = "GPUs per machine; none visible here"
    elif device == "cuda":
        nproc_candidates = list(range(machine.cuda_devices, 0, -1))
        hint = f"auto = {machine.cuda_devices} visible GPUs"
    else:
        nproc_candidates = [prof.CPU_DEFAULT_NPROC, *range(prof.CPU_DEFAULT_NPROC + 1, 65), 1]
        hint = f"auto = {prof.CPU_DEFAULT_NPROC} on cpu"
    ask.text("launch.nproc_per_node", f"Processes per machine (nproc_per_node; {hint})",
             default=_first_fitting("launch.nproc_per_node", nproc_candidates, answers=answers, machine=machine),
             missing="no GPU is visible here to count; pass --nproc-per-node N (GPUs per machine)")

    world = _world(answers, machine)
    nproc = _nproc(answers, machine)
    # CP inside one machine by default: the largest size that fits, as the shipped cp8 profiles.
    ask.text("parallelism.cp_size", f"CP size: ranks that split each sequence (world size {world})",
             default=_first_fitting("parallelism.cp_size", list(range(nproc, 0, -1)), answers=answers, machine=machine))
    ask.text("parallelism.tp_size", "TP size: tensor-parallel ranks", default=1)
    ask.text("parallelism.dp_replicate_size", "DP replicate size: HSDP replicas (full copies of the sharded model)",
             default=1)
    others = 1
    for path in ("parallelism.dp_replicate_size", "parallelism.cp_size", "parallelism.tp_size"):
        others *= answers[path]
    ask.text("parallelism.dp_shard_size",
             f"DP shard size: FSDP shards (world {world} / (dp_replicate * cp * tp) = {world // others})",
             default=world // others)

    if answers["parallelism.cp_size"] > 1:  # meaningless without CP: not asked, not written
        ask.select("parallelism.cp_comm_strategy", "CP comm strategy: how K/V move between CP ranks",
                   choices=STRATEGY_CHOICES, default="allgather")
        ask.confirm("parallelism.cp_load_balance",
                    "Load balance: head-tail sharding so causal attention work is even per rank?", default=True)
    ask.select("fsdp.mixed_precision", "Mixed precision", choices=PRECISION_CHOICES, default=prof.AUTO)
    ask.confirm("fsdp.activation_checkpointing",
                "Activation checkpointing: recompute block activations in backward to save memory?", default=False)


# ----------------------------------------------------------------------------- output


def profile_yaml(answers: Answers, *, output: Path) -> str:
    """The profile file: a header comment, then the answered keys in schema order."""
    tree: dict[str, Any] = {"version": prof.PROFILE_VERSION}
    for path in prof.FIELDS:
        if path in answers and path != "version":
            section, _, key = path.rpartition(".")
            (tree.setdefault(section, {}) if section else tree)[key] = answers[path]
    header = (
        "# cpctl profile written by `cpctl config`; check it with `cpctl check --config FILE`.\n"
        f"# Launch: {launch_command(output)}\n"
    )
    return header + prof.to_yaml(tree)


def launch_command(output: Path) -> str:
    return f"cpctl launch --config {shlex.quote(str(output))} your_script.py"


def _validated(text: str, *, answers: Answers, machine: prof.Machine) -> prof.Resolved:
    """Resolve exactly `text` as a profile, apart from any env var or other profile file."""
    if _device(answers, machine) == "cuda" and machine.cuda_devices == 0:
        # Written for another machine (e.g. from a login node): check it against that one.
        machine = prof.Machine(cuda_devices=_nproc(answers, machine) or 0)
    with tempfile.TemporaryDirectory(prefix="cpctl-config-") as empty:
        candidate = Path(empty) / "candidate.yaml"
        candidate.write_text(text, encoding="utf-8")
        isolated = {"XDG_CONFIG_HOME": empty, "HOME": empty}
        return prof.resolve(config=candidate, environ=isolated, cwd=empty, machine=machine)


def _write(output: Path, text: str) -> None:
    """Replace `output` in one step, so an interrupted write leaves no half file."""
    try:
        _replace(output, text)
    except OSError as exc:
        raise CpctlError(f"--output {output}: cannot write it ({exc.strerror or exc}); choose another path") from None


def _replace(output: Path, text: str) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
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


def summary_table(answers: Answers, resolved: prof.Resolved, *, output: Path) -> Table:
    table = Table(title=f"cpctl profile: {output}", title_justify="left")
    table.add_column("key", style="cyan")
    table.add_column("value")
    for path in prof.FIELDS:
        if path in answers and path != "version":
            value, final = answers[path], resolved.profile.get(path)
            table.add_row(path, _shown(value) + (f" (here: {_shown(final)})" if value != final else ""))
    return table


# ----------------------------------------------------------------------------- entry point


def _flag_answers(flags: Mapping[str, str], machine: prof.Machine) -> Answers:
    unknown = [path for path in flags if path not in prof.FIELDS]
    if unknown:
        raise CpctlError(f"{unknown[0]}: unknown profile key")
    tree, _ = prof.text_layer(flags, source_of=lambda spec: f"flag {spec.flag}")
    answers = {f"{key}.{sub}": value for key, section in tree.items() if isinstance(section, dict)
               for sub, value in section.items()}
    answers.update({key: value for key, value in tree.items() if not isinstance(value, dict)})
    error = cross_check(answers, machine=machine)
    if error is not None:
        given = " ".join(f"{prof.FIELDS[p].flag} {t}" for p, t in flags.items())
        raise CpctlError(f"flags {given}: {error}")
    return answers


def run_config(
    *,
    output: Path,
    assume_yes: bool,
    flags: dict[str, str],
    console: Console,
    interactive: bool | None = None,
    machine: prof.Machine | None = None,
) -> int:
    """`cpctl config`: ask (or take defaults and flags), validate, write `output`, summarise.

    Returns the exit code: 0 written, 1 overwrite declined or input ended, 130 on Ctrl-C.
    Raises CpctlError for a bad flag, an existing file under --yes, or an invalid profile.
    `interactive` defaults to "stdin is a terminal"; `machine` to the GPUs visible here.
    """
    output = Path(output)
    machine = prof.detect_machine() if machine is None else machine
    interactive = (sys.stdin.isatty() if interactive is None else interactive) and not assume_yes
    answers = _flag_answers(flags, machine)
    if output.is_dir():
        raise CpctlError(f"--output {output} is a directory; pass a file path such as {output / DEFAULT_OUTPUT}")
    if output.exists() and not interactive:
        raise CpctlError(f"{output} already exists; pass a new --output or delete the file (cpctl config never overwrites it unasked)")

    ask = _Asker(answers=answers, machine=machine, interactive=interactive)
    try:
        if interactive:
            if output.exists() and not ask.q.confirm(f"{output} exists. Overwrite it?", default=False).unsafe_ask():
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

    text = profile_yaml(answers, output=output)
    resolved = _validated(text, answers=answers, machine=machine)
    _write(output, text)
    console.print(summary_table(answers, resolved, output=output))
    console.print(Text(f"Wrote {output}. Launch with:"))
    console.print(Text("  " + launch_command(output), style="bold"))
    return EXIT_WRITTEN
