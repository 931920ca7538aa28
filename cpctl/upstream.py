"""What cpctl relies on in another library's code, stated and checked before it is relied on.

A `Shape` names what a patch (cpctl/integrations/patches.py) or a call into another library's
internals (torch's multi-head attention in cpctl/attention/dispatch.py) needs of the code it adapts:
the parameters it passes, the names the original must read (some exactly once), the owner's other
attributes it calls, the kind of attribute. `shape_problem` says what is missing, `shape_refusal`
says it in one line naming the releases cpctl supports. Torch-free, below every package that
adapts another library, so the engine and the integrations check the same way.
"""

from __future__ import annotations

import dis
import inspect
import types
from dataclasses import dataclass
from typing import Any

from cpctl.errors import CpctlError
from cpctl.versions import KNOWN_ACCELERATE, KNOWN_TRANSFORMERS, KNOWN_TRL, MIN_TORCH, installed_version

ABSENT = object()

# The releases cpctl supports, by the distribution a patched owner comes from, for the refusals.
SUPPORTED = {"accelerate": ", ".join(KNOWN_ACCELERATE), "transformers": ", ".join(KNOWN_TRANSFORMERS),
             "trl": ", ".join(KNOWN_TRL), "torch": ">= " + ".".join(map(str, MIN_TORCH))}


@dataclass(frozen=True)
class Shape:
    """What a patch relies on in the attribute it adapts (empty: only that the attribute exists)."""

    kind: type | None = None  # what the attribute must be (property: a patch that replaces its getter)
    parameters: tuple[str, ...] = ()  # names the callable takes: what the replacement passes it by
    reads: tuple[str, ...] = ()  # names its code (nested functions included) must use: what it reaches
    reads_once: tuple[str, ...] = ()  # attributes its own code reads exactly once: a patch that answers that read
    uses: tuple[str, ...] = ()  # other attributes of the owner the replacement calls


def shape_problem(owner: Any, name: str, shape: Shape) -> str | None:
    """None when `owner.name` has `shape`, else what differs, in a few words."""
    found = getattr(owner, name, ABSENT)
    if found is ABSENT:
        return f"no attribute {name}"
    if shape.kind is not None and not isinstance(found, shape.kind):
        return f"a {type(found).__name__}, not a {shape.kind.__name__}"
    problems = [f"no attribute {use}" for use in shape.uses if not hasattr(owner, use)]
    function = inspect.unwrap(found.fget if isinstance(found, property) else found)
    code = getattr(function, "__code__", None)
    if shape.parameters:
        try:
            taken = inspect.signature(function).parameters
        except (TypeError, ValueError):
            taken = {}
        problems += [f"no parameter {parameter}" for parameter in shape.parameters if parameter not in taken]
    read = names_read(code) if code is not None else set()
    problems += [f"no use of {what}" for what in shape.reads if what not in read]
    counts = _attribute_reads(code) if code is not None else {}
    problems += [f"{counts.get(what, 0)} reads of {what}, not one" for what in shape.reads_once
                 if counts.get(what, 0) != 1]
    return ", ".join(problems) or None


def shape_refusal(owner: Any, name: str, shape: Shape) -> str | None:
    """None when `owner.name` has `shape`, else the one line that says so, naming the releases
    cpctl supports of the library it comes from."""
    problem = shape_problem(owner, name, shape)
    if problem is None:
        return None
    module = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(owner, "__module__", None)
    distribution = (module or type(owner).__module__).partition(".")[0]
    version = installed_version(distribution)
    release = f"{distribution} {version}" if version else distribution
    supported = (f"{distribution} {SUPPORTED[distribution]}" if distribution in SUPPORTED
                 else "the releases in cpctl.versions")
    return f"{qualified_name(owner)}.{name} of {release} is not what cpctl adapts ({problem}); cpctl supports {supported}"


def require_shape(owner: Any, name: str, shape: Shape) -> None:
    """A CpctlError of one line (`shape_refusal`) when `owner.name` lacks `shape`."""
    refusal = shape_refusal(owner, name, shape)
    if refusal is not None:
        raise CpctlError(refusal)


def module_uses(module: types.ModuleType | None, name: str) -> bool:
    """Whether a function or method defined in `module` (nested functions included) uses `name`,
    as a global or an attribute: read from the code objects, so comments and strings do not count."""
    if module is None:
        return False
    defined = [value for value in vars(module).values() if getattr(value, "__module__", None) == module.__name__]
    members = [member for value in defined if isinstance(value, type) for member in vars(value).values()]
    for value in (*defined, *members):
        for function in (value.fget, value.fset) if isinstance(value, property) else (value,):
            code = getattr(getattr(function, "__func__", function), "__code__", None)
            if isinstance(code, types.CodeType) and name in names_read(code):
                return True
    return False


def names_read(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` and the functions nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= names_read(constant)
    return names


def _attribute_reads(code: types.CodeType) -> dict[str, int]:
    """How often `code` itself reads each attribute (`x.name`), by name."""
    counts: dict[str, int] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            counts[instruction.argval] = counts.get(instruction.argval, 0) + 1
    return counts


def uncompiled(model: Any) -> Any:
    """The module torch.compile wrapped when `model` is its wrapper (an OptimizedModule), else
    `model` itself. Known by the wrapper's type name and `_orig_mod`, so asking imports no
    torch._dynamo (seconds in every process that never compiles)."""
    if type(model).__name__ == "OptimizedModule":
        return getattr(model, "_orig_mod", model)
    return model


def qualified_name(owner: Any) -> str:
    """A class by its qualified name, a module by its name."""
    return str(getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or owner)
