"""Which API a training script is written with, read from its source (`launch.script_api: auto`).

`cpctl launch` starts a script in one of two ways: as a cpctl script (its `cpctl.init()` reads
the profile) or as an accelerate script (the profile becomes accelerate's variables and the
worker starts in cpctl.integrations.accelerate_shim). Started the wrong way, a script still runs, but
without context parallelism: an Accelerator that no one configured, or a `cpctl.init()` that
accelerate never calls. So the script's source is read first, with `ast` (nothing is imported
or run): a use of `cpctl.init` is the cpctl API; a use of accelerate's `Accelerator`, of a
transformers `Trainer` (`Seq2SeqTrainer`, ...) or of a TRL trainer (`SFTTrainer`, ...) is
accelerate's. The modules it imports from its own directory (or, for `-m`, from the working
directory and its own package) are read too, since a script often keeps its loop in one.

Torch-free: `cpctl launch --dry-run` says what was found, and where.
"""

from __future__ import annotations

import ast
import importlib.machinery
import sys
from dataclasses import dataclass
from pathlib import Path

from cpctl.errors import CpctlError

CPCTL, ACCELERATE = "cpctl", "accelerate"
MAX_FILES = 64  # local modules read, at most: a script's own helpers, not a whole library
# Never read: their sources use the APIs themselves (cpctl's accelerate shim builds Accelerators).
LIBRARIES = frozenset({"cpctl", "accelerate", "transformers", "trl", "torch", "peft", "datasets", "deepspeed"})
PASS_THE_FLAG = "pass --script-api cpctl or --script-api accelerate"


@dataclass(frozen=True)
class Evidence:
    """One use of an API in the source: which API, what the use is, where."""

    api: str
    what: str  # "calls cpctl.init()", "builds an Accelerator", "uses transformers' Trainer"
    file: Path
    line: int

    def shown(self, *, cwd: Path) -> str:
        return f"{_relative(self.file, cwd)}:{self.line} {self.what}"


@dataclass(frozen=True)
class ScriptUse:
    """What the source of a script (and of the local modules it imports) shows."""

    target: str  # as given to cpctl launch: a path, or a module name with `-m`
    files: tuple[Path, ...]  # the files read, the script's own first
    evidence: tuple[Evidence, ...]
    options: frozenset[str]  # string literals that look like options ("--lr"): what the script may take
    problem: str | None = None  # why the script itself could not be read
    cwd: Path = Path(".")

    def first(self, api: str) -> Evidence | None:
        return next((item for item in self.evidence if item.api == api), None)

    def route(self, *, cp_size: int) -> tuple[str, str]:
        """(the API to start the script with, why), or CpctlError when the source cannot decide
        and guessing could run the job without the context parallelism it asks for."""
        cpctl, accelerate = self.first(CPCTL), self.first(ACCELERATE)
        if cpctl is not None and accelerate is not None:
            raise CpctlError(f"{self.target}: {cpctl.shown(cwd=self.cwd)} and {accelerate.shown(cwd=self.cwd)}; "
                             f"cannot tell which of the two starts the processes: {PASS_THE_FLAG}")
        found = cpctl or accelerate
        if found is not None:
            return found.api, found.shown(cwd=self.cwd)
        looked = self.problem or f"read {_files(len(self.files))}"
        if cp_size == 1:
            return CPCTL, f"{self.target}: neither cpctl.init() nor an Accelerator or Trainer found ({looked}); no CP to set up"
        raise CpctlError(
            f"{self.target}: neither cpctl.init() nor an Accelerator or Trainer found ({looked}); with cp_size {cp_size} "
            "its processes would run without context parallelism: call cpctl.init() in it, or pass --script-api cpctl "
            "(it reaches cpctl.init() another way) or --script-api accelerate (an accelerate or Trainer script)")


def disagreement(use: ScriptUse, *, api: str, cp_size: int) -> str | None:
    """Why starting the script as `api` (set explicitly) looks wrong from its source; None if not."""
    other = ACCELERATE if api == CPCTL else CPCTL
    found = use.first(other)
    if cp_size == 1 or found is None or use.first(api) is not None:
        return None
    missing = "cpctl.init()" if api == CPCTL else "Accelerator or Trainer"
    return (f"{use.target} starts as a{'n' if api == ACCELERATE else ''} {api} script (launch.script_api {api}), but "
            f"{found.shown(cwd=use.cwd)} and its source shows no {missing}: if so, its processes run without "
            f"context parallelism (launch.script_api auto reads it from the source)")


def detect(target: str, *, module: bool, cwd: Path) -> ScriptUse | None:
    """Read `target` (a script path, or a module name with `module`) and the local modules it
    imports; None when the target cannot be found (the launch then says so itself)."""
    if module:  # where `python -m` finds it: the working directory, then the installed packages
        origin = _module_file(target, search=[cwd, *map(Path, sys.path[1:])], main=True)
    else:
        origin = cwd / target if (cwd / target).is_file() else None
    if origin is None:
        return None
    roots = [cwd] if module else [origin.parent]  # sys.path[0] of `python -m` / of `python SCRIPT`
    files: list[Path] = []
    evidence: list[Evidence] = []
    options: set[str] = set()
    problem = None
    queue, seen = [origin], {origin.resolve()}
    while queue and len(files) < MAX_FILES:
        path = queue.pop(0)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError) as exc:
            if path == origin:
                line = getattr(exc, "lineno", None)
                problem = f"cannot read it: {type(exc).__name__}" + (f" at line {line}" if line else "")
            continue
        except RecursionError:  # a source nested too deep for ast
            if path == origin:
                problem = "cannot read it: nested too deep"
            continue
        files.append(path)
        reader = _Reader(path)
        reader.visit(tree)
        evidence += reader.evidence
        options |= reader.options
        for name, package in reader.imports:
            found = _local_module(name, package=package, roots=roots)
            if found is not None and found.resolve() not in seen:
                seen.add(found.resolve())
                queue.append(found)
    return ScriptUse(target, tuple(files), tuple(evidence), frozenset(options), problem, cwd)


# ----------------------------------------------------------------------------- reading one file


def _api_of(qualified: str) -> tuple[str, str] | None:
    """The API a dotted name (or an attribute of it: `Accelerator.prepare`) belongs to, and
    what using it means; None for anything else."""
    parts = qualified.split(".")
    for end in range(2, len(parts) + 1):
        head, name = parts[0], parts[end - 1]
        if head == "cpctl" and name == "init" and end == 2:
            return CPCTL, "calls cpctl.init()"
        if head == "accelerate" and name == "Accelerator":
            return ACCELERATE, "builds an Accelerator"
        if head in ("transformers", "trl") and name.endswith("Trainer"):
            owner = "transformers'" if head == "transformers" else "TRL's"
            return ACCELERATE, f"uses {owner} {name}"
    return None


class _Reader(ast.NodeVisitor):
    """The names a file imports (as dotted names), the API names it uses, its option-like strings."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bound: dict[str, str] = {}  # local name -> dotted name it was imported as
        # modules to look for: (dotted name, the directory a relative import starts from, else None)
        self.imports: list[tuple[str, Path | None]] = []
        self.evidence: list[Evidence] = []
        self.options: set[str] = set()
        self._seen: set[str] = set()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((alias.name, None))
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.bound[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        package = None
        if node.level:  # relative: from the file's own package, `level - 1` folders up
            package = self.path.parent
            for _ in range(node.level - 1):
                package = package.parent
        # `from a import b`: b may be a module of package a
        names = [base, *(f"{base}.{alias.name}".lstrip(".") for alias in node.names if alias.name != "*")]
        self.imports += [(name, package) for name in names if name]
        if node.level:
            return
        for alias in node.names:
            self.bound[alias.asname or alias.name] = f"{base}.{alias.name}"

    def visit_Name(self, node: ast.Name) -> None:
        self._use(self.bound.get(node.id), node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _dotted(node)
        if chain is not None:
            head, _, rest = chain.partition(".")
            if head in self.bound:
                self._use(f"{self.bound[head]}.{rest}", node)
                return
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value.startswith("-") and len(node.value) < 64:
            self.options.add(node.value.split("=")[0])

    def _use(self, qualified: str | None, node: ast.AST) -> None:
        found = _api_of(qualified) if qualified else None
        if found is not None and found[1] not in self._seen:
            self._seen.add(found[1])
            self.evidence.append(Evidence(found[0], found[1], self.path, getattr(node, "lineno", 0)))


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


# ----------------------------------------------------------------------------- finding local modules


def _local_module(name: str, *, package: Path | None, roots: list[Path]) -> Path | None:
    """The file of module `name` when it is the script's own: relative to `package`, or found
    under `roots` (never a library: see LIBRARIES)."""
    if package is not None:
        return _module_file(name, search=[package])
    if name.split(".")[0] in LIBRARIES:
        return None
    return _module_file(name, search=roots)


def _module_file(name: str, *, search: list[Path], main: bool = False) -> Path | None:
    """Where `import name` would find its source under `search`, without importing anything;
    with `main`, a package's __main__.py (what `python -m package` runs)."""
    path: list[str] | None = [str(place) for place in search]
    spec = None
    for part in name.split("."):
        if path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin)
    if main and spec.submodule_search_locations is not None:
        return origin.parent / "__main__.py"
    return origin  # not Python source (an extension module): read as a file that does not parse


def _relative(path: Path, cwd: Path) -> str:
    try:
        return str(path.resolve().relative_to(cwd.resolve()))
    except ValueError:
        return str(path)


def _files(count: int) -> str:
    return f"{count} file{'' if count == 1 else 's'}"
