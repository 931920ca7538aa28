"""The one exception type cpctl raises for anything the user can fix.

Library code raises it with a message that names the fix; only the CLI catches it,
prints the message on one line and exits with code 2.
"""


class CpctlError(Exception):
    """A user-facing error: bad profile, bad flag, bad input to the runtime."""


# How a failed worker reports its error to `cpctl launch` (written by cpctl.runtime.process, read by
# cpctl.launch.launcher; both import these names from here, which imports no torch):
ERROR_DIR_ENV_VAR = "CPCTL_ERROR_DIR"  # set by the launcher: a fresh directory per launch, for tracebacks
REPORT_KEY = "cpctl"  # cpctl's part of a worker's torchelastic error file (TORCHELASTIC_ERROR_FILE)
