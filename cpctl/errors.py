"""The one exception type cpctl raises for anything the user can fix.

Library code raises it with a message that names the fix; only the CLI catches it,
prints the message on one line and exits with code 2.
"""


class CpctlError(Exception):
    """A user-facing error: bad profile, bad flag, bad input to the runtime."""
