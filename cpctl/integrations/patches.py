"""Every change cpctl makes to another library's code, in one registry: applied together, undone together.

A patch replaces one attribute of a class of accelerate, transformers or TRL (`PATCHES.replace`),
or adds one entry to a library's own registry of implementations by name (`PATCHES.register`:
transformers' attention and mask functions), in the worker process only, for the releases
cpctl checked (cpctl.versions). The modules that know why (accelerate_shim, trainer, trl,
huggingface, ...) hand their changes to `PATCHES`, and `remove()` puts every original back,
newest first. Nothing else in cpctl assigns another library's attributes or entries, so this
module is the list of what cpctl changes there (`applied()` names them).

Each patch states what it relies on in the code it adapts (a `Shape`, cpctl/upstream.py: the parameters it passes,
the names the original must read, the owner's other attributes it calls), checked before
anything is replaced: a release that changed it is one line naming the releases cpctl supports,
not a run that goes wrong later. What cpctl remembers about another library's objects (a model
it prepared, the sizes a config asked for) is noted here too (`note`), not set on them, and is
forgotten with the patches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpctl.errors import CpctlError
from cpctl.upstream import ABSENT, Shape, qualified_name, require_shape
from cpctl.versions import installed_version, is_known

@dataclass(frozen=True)
class Applied:
    owner: Any  # the class or object whose attribute was replaced, or the mapping given an entry
    name: str  # the attribute, or the entry's key
    original: Any  # ABSENT when the owner had no attribute (entry) of its own
    why: str
    label: str  # how applied() names the owner
    entry: bool = False  # owner[name] rather than owner.name


class Patches:
    """The patches applied in this process, to undo as one."""

    def __init__(self) -> None:
        self._applied: list[Applied] = []
        self._notes: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}  # by id: configs are unhashable dataclasses

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], *, why: str, needs: Shape = Shape()) -> None:
        """`owner.name = make(original)`; `original` is what the attribute resolved to before, which
        must have the shape `needs` (checked first: a CpctlError of one line, nothing replaced)."""
        require_shape(owner, name, needs)
        own = owner.__dict__.get(name, ABSENT) if isinstance(owner, type) else getattr(owner, name, ABSENT)
        resolved = getattr(owner, name)
        self._applied.append(Applied(owner, name, own, why, label=f"{qualified_name(owner)}.{name}"))
        setattr(owner, name, make(resolved))

    def register(self, registry: type, key: str, value: Any, *, why: str) -> None:
        """`registry.register(key, value)` for a transformers-style registry of implementations by
        name (a GeneralInterface: AttentionInterface, AttentionMaskInterface), whose class-wide
        entries live in its `_global_mapping` dict; undone by restoring that entry."""
        mapping = registry.__dict__.get("_global_mapping")
        if not isinstance(mapping, dict) or not callable(getattr(registry, "register", None)):
            raise CpctlError(f"{registry.__qualname__} is not the registry cpctl knows (a class-wide _global_mapping "
                             "dict and register()); the transformers release installed changed it")
        self._applied.append(Applied(mapping, key, mapping.get(key, ABSENT), why,
                                     label=f"{registry.__qualname__}[{key!r}]", entry=True))
        registry.register(key, value)

    def applied(self) -> list[str]:
        """`Owner.name: why` (`Registry['key']: why`), for every patch in place."""
        return [f"{a.label}: {a.why}" for a in self._applied]

    def is_patched(self, owner: Any, name: str) -> bool:
        """Whether `owner.name` is replaced, or `owner` (a registry) has cpctl's entry `name`."""
        mapping = owner.__dict__.get("_global_mapping") if isinstance(owner, type) else None
        return any((a.owner is owner or (a.entry and a.owner is mapping)) and a.name == name for a in self._applied)

    def note(self, obj: Any, key: str, value: Any) -> None:
        """Remember `value` about another library's `obj` (held weakly), instead of setting it on `obj`."""
        ident = id(obj)
        entry = self._notes.get(ident)
        if entry is None or entry[0]() is not obj:

            def forget(ref: weakref.ref) -> None:  # obj is gone: its id may be another object's next
                if self._notes.get(ident, (None,))[0] is ref:
                    del self._notes[ident]

            entry = self._notes[ident] = (weakref.ref(obj, forget), {})
        entry[1][key] = value

    def noted(self, obj: Any, key: str, default: Any = None) -> Any:
        """What `note` remembered about `obj` under `key`, or `default`."""
        entry = self._notes.get(id(obj))
        return entry[1].get(key, default) if entry is not None and entry[0]() is obj else default

    def remove(self) -> None:
        self._notes.clear()
        while self._applied:
            patch = self._applied.pop()
            if patch.entry:
                if patch.original is ABSENT:
                    patch.owner.pop(patch.name, None)
                else:
                    patch.owner[patch.name] = patch.original
            elif patch.original is ABSENT:
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
