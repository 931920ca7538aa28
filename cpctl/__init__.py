"""cpctl: context parallelism for PyTorch long-sequence training, as one flag.

`import cpctl` stays light (no torch): the CLI imports this package too. The runtime API is
loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Checkpointer", "CpctlError", "init", "position_ids_for_documents", "position_ids_from_document_ids", "position_ids_like",
           "shift_labels", "__version__"]

from cpctl.errors import CpctlError

if TYPE_CHECKING:
    from cpctl.runtime.runtime import Runtime


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":  # imports torch: only on use
        from cpctl.runtime.checkpoint import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'cpctl' has no attribute {name!r}")


def init(**overrides: Any) -> "Runtime":
    """Start (or return) this process's cpctl runtime. See `cpctl.runtime.runtime.init`.

    Here the built-in integrations register what they know with the runtime (which never
    imports them): transformers models."""
    from cpctl.integrations import huggingface
    from cpctl.runtime.runtime import init as _init

    huggingface.register()
    return _init(**overrides)


def shift_labels(input_ids: Any, ignore_index: int = -100, position_ids: Any = None) -> Any:
    from cpctl.runtime.data import shift_labels as _shift_labels

    return _shift_labels(input_ids, ignore_index=ignore_index, position_ids=position_ids)


def position_ids_for_documents(lengths: Any, device: Any = None) -> Any:
    from cpctl.runtime.data import (
        position_ids_for_documents as _position_ids_for_documents,
    )

    return _position_ids_for_documents(lengths, device=device)


def position_ids_from_document_ids(document_ids: Any) -> Any:
    from cpctl.runtime.data import (
        position_ids_from_document_ids as _position_ids_from_document_ids,
    )

    return _position_ids_from_document_ids(document_ids)


def position_ids_like(input_ids: Any) -> Any:
    from cpctl.runtime.data import position_ids_like as _position_ids_like

    return _position_ids_like(input_ids)
