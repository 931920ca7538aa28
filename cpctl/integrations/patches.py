"""Every change cpctl makes to another library's code, in one registry: applied together, undone together.

A patch replaces one attribute of a class of accelerate, transformers or TRL, in the worker
process only, for the releases cpctl checked (cpctl.versions): the modules that know why
(accelerate_shim, trainer, trl) hand their replacements to `PATCHES.replace`, and `remove()`
puts every original back, newest first. Nothing else in cpctl assigns another library's
attributes, so this module is the list of what cpctl changes there (`applied()` names them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpctl.errors import CpctlError
from cpctl.versions import installed_version, is_known

_MISSING = object()


@dataclass(frozen=True)
class Applied:
    owner: Any
    name: str
    original: Any  # _MISSING when the owner had no attribute of its own
    why: str


class Patches:
    """The patches applied in this process, to undo as one."""

    def __init__(self) -> None:
        self._applied: list[Applied] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], *, why: str) -> None:
        """`owner.name = make(original)`; `original` is what the attribute resolved to before."""
        own = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        resolved = getattr(owner, name, None)
        self._applied.append(Applied(owner, name, own, why))
        setattr(owner, name, make(resolved))

    def applied(self) -> list[str]:
        """`Owner.name: why`, for every patch in place."""
        return [f"{getattr(a.owner, '__qualname__', a.owner)}.{a.name}: {a.why}" for a in self._applied]

    def is_patched(self, owner: Any, name: str) -> bool:
        return any(a.owner is owner and a.name == name for a in self._applied)

    def remove(self) -> None:
        while self._applied:
            patch = self._applied.pop()
            if patch.original is _MISSING:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)


PATCHES = Patches()


def require_known(distribution: str, known: tuple[str, ...], *, what: str) -> str:
    """The installed release of `distribution`, or a CpctlError when cpctl has not checked it."""
    version = installed_version(distribution)
    if version is None or not is_known(version, known):
        found = f"{distribution} {version}" if version else f"{distribution} (not installed)"
        raise CpctlError(f"{found} is not a release cpctl knows for {what} ({', '.join(known)}): the code cpctl "
                         f"adapts may have changed; install {distribution}=={known[-1]}.*")
    return version
