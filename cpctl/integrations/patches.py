"""Every change cpctl makes to another library's code, in one registry: applied together, undone together.

A patch replaces one attribute of a class of accelerate, transformers or TRL (`PATCHES.replace`),
or adds one entry to a library's own registry of implementations by name (`PATCHES.register`:
transformers' attention and mask functions), in the worker process only, for the releases
cpctl checked (cpctl.versions). The modules that know why (accelerate_shim, trainer, trl,
huggingface, ...) hand their changes to `PATCHES`, and `remove()` puts every original back,
newest first. Nothing else in cpctl assigns another library's attributes or entries, so this
module is the list of what cpctl changes there (`applied()` names them).
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
    owner: Any  # the class or object whose attribute was replaced, or the mapping given an entry
    name: str  # the attribute, or the entry's key
    original: Any  # _MISSING when the owner had no attribute (entry) of its own
    why: str
    label: str  # how applied() names the owner
    entry: bool = False  # owner[name] rather than owner.name


class Patches:
    """The patches applied in this process, to undo as one."""

    def __init__(self) -> None:
        self._applied: list[Applied] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], *, why: str) -> None:
        """`owner.name = make(original)`; `original` is what the attribute resolved to before."""
        own = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        resolved = getattr(owner, name, None)
        self._applied.append(Applied(owner, name, own, why, label=f"{getattr(owner, '__qualname__', owner)}.{name}"))
        setattr(owner, name, make(resolved))

    def register(self, registry: type, key: str, value: Any, *, why: str) -> None:
        """`registry.register(key, value)` for a transformers-style registry of implementations by
        name (a GeneralInterface: AttentionInterface, AttentionMaskInterface), whose class-wide
        entries live in its `_global_mapping` dict; undone by restoring that entry."""
        mapping = registry.__dict__.get("_global_mapping")
        if not isinstance(mapping, dict) or not callable(getattr(registry, "register", None)):
            raise CpctlError(f"{registry.__qualname__} is not the registry cpctl knows (a class-wide _global_mapping "
                             "dict and register()); the transformers release installed changed it")
        self._applied.append(Applied(mapping, key, mapping.get(key, _MISSING), why,
                                     label=f"{registry.__qualname__}[{key!r}]", entry=True))
        registry.register(key, value)

    def applied(self) -> list[str]:
        """`Owner.name: why` (`Registry['key']: why`), for every patch in place."""
        return [f"{a.label}: {a.why}" for a in self._applied]

    def is_patched(self, owner: Any, name: str) -> bool:
        """Whether `owner.name` is replaced, or `owner` (a registry) has cpctl's entry `name`."""
        mapping = owner.__dict__.get("_global_mapping") if isinstance(owner, type) else None
        return any((a.owner is owner or (a.entry and a.owner is mapping)) and a.name == name for a in self._applied)

    def remove(self) -> None:
        while self._applied:
            patch = self._applied.pop()
            if patch.entry:
                if patch.original is _MISSING:
                    patch.owner.pop(patch.name, None)
                else:
                    patch.owner[patch.name] = patch.original
            elif patch.original is _MISSING:
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
