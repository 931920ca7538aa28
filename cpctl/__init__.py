"""cpctl: context parallelism for PyTorch long-sequence training, as one flag.

`import cpctl` stays light (no torch): the CLI imports this package too. The runtime API is
loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["CpctlError", "init", "position_ids_like", "shift_labels", "__version__"]

from cpctl.errors import CpctlError

if TYPE_CHECKING:
    from cpctl.runtime import Runtime


def init(**overrides: Any) -> "Runtime":
    """Start (or return) this process's cpctl runtime. See `cpctl.runtime.init`."""
    from cpctl.runtime import init as _init

    return _init(**overrides)


def shift_labels(input_ids: Any, ignore_index: int = -100) -> Any:
    from cpctl.data import shift_labels as _shift_labels

    return _shift_labels(input_ids, ignore_index=ignore_index)


def position_ids_like(input_ids: Any) -> Any:
    from cpctl.data import position_ids_like as _position_ids_like

    return _position_ids_like(input_ids)
