"""The one exception type cpctl raises for anything the user can fix.

Library code raises it with a message that names the fix; only the CLI catches it,
prints the message on one line and exits with code 2, or with a LaunchError's own code.
"""


class CpctlError(Exception):
    """A user-facing error: bad profile, bad flag, bad input to the runtime."""


class LaunchError(CpctlError):
    """The workers ran and failed, or the launch was interrupted: carries the exit code to use."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def first_line(text: str) -> str:
    """The first non-blank line of a message, at most 300 characters: what a one-line error quotes."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
