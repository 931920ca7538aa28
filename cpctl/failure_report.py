"""A failed worker's report to `cpctl launch`: one definition for the side that writes it
(cpctl.runtime.process, in the worker) and the side that reads it (cpctl.launch.failures).
With it, the checkpoint a restart resumes from (CheckpointNote, written by cpctl's Checkpointer).

Under `cpctl launch` (ERROR_DIR_ENV_VAR set) a worker that raises writes its full traceback to
ERROR_DIR/rank{R}-traceback.txt and its torchelastic error file (TORCHELASTIC_ERROR_FILE, the
file `@record` writes): torchelastic's own format, which its agent reads back into each
ProcessFailure's `error_file_data`, with this report under REPORT_KEY. Torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV_VAR = "CPCTL_ERROR_DIR"  # set by the launcher: a fresh directory per launch, for tracebacks
REPORT_KEY = "cpctl"  # cpctl's part of a worker's torchelastic error file
TRACEBACK_GLOB = "*traceback*.txt"  # what traceback_path names, in the error directory
CHECKPOINT_NOTE = "checkpoint.json"  # in the error directory: CheckpointNote


def traceback_path(error_dir: Path, *, rank: int, attempt: int, restarts: int) -> Path:
    """Where a rank writes its traceback; with restarts, each attempt keeps its own."""
    attempt_tag = f"-attempt{attempt}" if restarts else ""
    return error_dir / f"rank{rank}{attempt_tag}-traceback.txt"


@dataclass(frozen=True)
class FailureReport:
    """One rank's failure, in one line, with where its traceback is."""

    rank: int
    host: str
    summary: str  # one line: a CpctlError's message, else the exception's type and first line
    traceback_file: str
    time: float  # seconds since the epoch, when the worker reported
    peer_lost: bool  # the exception most likely reports a peer that went away
    after: FailureReport | None = None  # the rank that failed before this one, as it reported itself

    @property
    def first(self) -> FailureReport:
        """The report of the rank that failed first, as far as this rank knows."""
        return self.after or self

    @property
    def secondary(self) -> bool:
        """Another rank's failure caused this one (it failed first, or this rank lost its peer)."""
        return self.after is not None or self.peer_lost

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureReport | None:
        """The report `to_json` wrote; None for anything else."""
        try:
            return cls.from_dict(json.loads(text))
        except ValueError:
            return None

    @classmethod
    def from_dict(cls, data: object) -> FailureReport | None:
        """A report from `dataclasses.asdict` form (parsed JSON); None when `data` is not one."""
        if not isinstance(data, dict):
            return None
        names = {field.name for field in dataclasses.fields(cls)}
        if set(data) != names:
            return None
        after = None if data["after"] is None else cls.from_dict(data["after"])
        if data["after"] is not None and after is None:
            return None
        values = {name: data[name] for name in names - {"after"}}
        report = cls(**values, after=after)
        return report if report._typed() else None

    def _typed(self) -> bool:
        """Whether each value has its field's type (JSON keeps a float's integral value as an int)."""
        return (type(self.rank) is int and isinstance(self.host, str) and isinstance(self.summary, str)
                and isinstance(self.traceback_file, str) and type(self.time) in (int, float)
                and type(self.peer_lost) is bool)

    def error_file_json(self, *, traceback_text: str) -> str:
        """The worker's torchelastic error file: torchelastic's format (ErrorHandler.record_exception),
        whose message its agent shows, and this report under REPORT_KEY."""
        message = {"message": self.summary,
                   "extraInfo": {"py_callstack": traceback_text, "timestamp": str(int(self.time))}}
        return json.dumps({"message": message, REPORT_KEY: dataclasses.asdict(self)})

    @classmethod
    def from_error_file_data(cls, data: object) -> FailureReport | None:
        """The report in an error file torchelastic read (a ProcessFailure's `error_file_data`);
        None when the worker wrote none (it exited, was killed, or failed before cpctl.init())."""
        return cls.from_dict(data.get(REPORT_KEY)) if isinstance(data, dict) else None


@dataclass(frozen=True)
class CheckpointNote:
    """The newest checkpoint this launch's workers completed or loaded, as rank 0 of cpctl's
    Checkpointer notes it (`note_checkpoint`): the one `load_latest` resumes from after a restart,
    which the launcher names in its restart line. Written right after the checkpoint's rename, so
    a kill between the two leaves it one checkpoint behind."""

    step: int
    path: str

    @classmethod
    def read(cls, error_dir: Path) -> CheckpointNote | None:
        """The note in `error_dir`; None when the workers wrote none (no cpctl checkpoint yet)."""
        try:
            data = json.loads((error_dir / CHECKPOINT_NOTE).read_text())
            note = cls(step=data["step"], path=data["path"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return note if type(note.step) is int and isinstance(note.path, str) else None


def note_checkpoint(path: Path, *, step: int) -> None:
    """In a worker of `cpctl launch` (ERROR_DIR_ENV_VAR set): note checkpoint `path` (step `step`)
    as the one a restart resumes from. Anywhere else nothing; never an error (a save or load must
    not fail for the launcher's line)."""
    error_dir = os.environ.get(ERROR_DIR_ENV_VAR)
    if not error_dir:
        return
    note = Path(error_dir) / CHECKPOINT_NOTE
    written = note.with_name(f"{note.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        written.write_text(json.dumps({"step": step, "path": str(Path(path).absolute())}))
        written.replace(note)  # whole, or the previous note
