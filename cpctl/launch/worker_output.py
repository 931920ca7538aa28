"""The workers' lines on the launcher's console: each prefixed with its global rank, once.

torchrun tees every local rank's stdout and stderr (TEE_ALL) to this console, prefixing each
line with the template in LOG_PREFIX_ENV_VAR. A worker that started torch.distributed itself
(not through cpctl.init: accelerate, a plain torch script) has torch's excepthook prefix each
traceback line with the same "[rankN]: ", so the launcher writes such a doubled prefix once.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import TextIO, cast

# torchrun reads the per-line prefix template of tee'd worker output from this variable.
LOG_PREFIX_ENV_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LOG_PREFIX = "[rank${rank}]: "
TEE_ALL = "3"  # stdout and stderr of every local rank, to console (prefixed) and to log files


class _SinglePrefix:
    """A console stream that writes a doubled rank prefix once; all else is the stream's own."""

    DOUBLED = re.compile(r"^(\[rank\d+\]: )\1+", re.MULTILINE)

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(self.DOUBLED.sub(r"\1", text))

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def single_rank_prefix() -> Iterator[None]:
    """sys.stdout and sys.stderr, where torchrun's tee writes the workers' lines, as _SinglePrefix."""
    saved = sys.stdout, sys.stderr
    # a stand-in for the stream, not a subclass: every attribute but write is the stream's
    sys.stdout, sys.stderr = cast(TextIO, _SinglePrefix(sys.stdout)), cast(TextIO, _SinglePrefix(sys.stderr))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
