"""The package's shape, read from its source with `ast` (nothing is imported; milliseconds).

* No import cycle among cpctl's modules. Every import counts, wherever it is written: at
  module level, inside a function (a lazy import is still a dependency), under
  `TYPE_CHECKING` (a type named from above is a dependency too). A package's `__init__` is
  the package: what it imports (its re-exports) the package imports.
* docs/architecture.md, the map, names every module the package has.
* The worker side's packages import downward only: attention below runtime below
  integrations (the runtime asks registered adapters instead of importing an integration).
* The Hugging Face integration sees the runtime through `RuntimeView` only: every member it
  calls on the runtime is declared there, and the step context it is handed has every member
  declared there. The user's `Runtime` has exactly the members docs/runtime.md documents.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def modules_of(root: Path, package: str = "cpctl") -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root/package` (a package is its __init__)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_by(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:  # `from pkg import mod` imports pkg.mod; `from mod import name`, mod
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in targets if target in modules and target != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = modules_of(root)
    return {name: imported_by(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_cpctl_has_no_import_cycle() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 50 and "cpctl.runtime.runtime" in graph["cpctl"]  # the lazy import in __getattr__ counts
    assert cycles(graph) == [], "import cycles among cpctl's modules (cut them with a narrow interface below both)"


def write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CLEAN = {
    "cpctl/__init__.py": "",
    "cpctl/errors.py": "",
    "cpctl/low/__init__.py": "from cpctl.low.leaf import thing\n",
    "cpctl/low/leaf.py": "from cpctl.errors import Error\nfrom . import sibling\n",
    "cpctl/low/sibling.py": "import cpctl.errors\n",
    "cpctl/high.py": "from cpctl.low import thing\n\ndef later():\n    from cpctl.low import leaf\n",
}


def test_a_clean_tree_has_no_cycle(tmp_path: Path) -> None:
    graph = import_graph(write(tmp_path, CLEAN))
    assert graph["cpctl.low"] == {"cpctl.low.leaf"}  # the re-export: the package imports its child
    assert graph["cpctl.low.leaf"] == {"cpctl.errors", "cpctl.low.sibling"}  # relative, resolved
    assert graph["cpctl.high"] == {"cpctl.low", "cpctl.low.leaf"}
    assert cycles(graph) == []


BACK_EDGES = {  # each closes a cycle through the clean tree, written as the cycles this test exists for
    "function-level": ("cpctl/errors.py", "def late():\n    from cpctl.high import later\n",
                       ["cpctl.errors", "cpctl.high", "cpctl.low", "cpctl.low.leaf", "cpctl.low.sibling"]),
    "TYPE_CHECKING": ("cpctl/low/sibling.py",
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cpctl.high import later\n",
                      ["cpctl.high", "cpctl.low", "cpctl.low.leaf", "cpctl.low.sibling"]),
    "a package's re-export": ("cpctl/low/sibling.py", "from cpctl.low import thing\n",
                              ["cpctl.low", "cpctl.low.leaf", "cpctl.low.sibling"]),
    "relative": ("cpctl/low/sibling.py", "from .. import high\n",
                 ["cpctl.high", "cpctl.low", "cpctl.low.leaf", "cpctl.low.sibling"]),
}


@pytest.mark.parametrize("kind", BACK_EDGES)
def test_every_kind_of_import_closes_a_cycle(tmp_path: Path, kind: str) -> None:
    relative, text, cycle = BACK_EDGES[kind]
    assert cycles(import_graph(write(tmp_path, {**CLEAN, relative: text}))) == [cycle]


# ------------------------------------------------------------------------------- direction between packages

WORKER_LAYERS = ("attention", "runtime", "integrations")  # lowest first: each imports only those below it


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a worker package imports one above it."""
    def layer(module: str) -> int | None:
        parts = module.split(".")
        return WORKER_LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in WORKER_LAYERS else None

    return sorted((name, target) for name, targets in graph.items() for target in targets
                  if layer(name) is not None and layer(target) is not None and layer(target) > layer(name))


def test_the_worker_packages_import_downward_only() -> None:
    assert upward_imports(import_graph(REPO)) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    tree = {"cpctl/__init__.py": "", "cpctl/runtime/__init__.py": "", "cpctl/integrations/__init__.py": "",
            "cpctl/integrations/hf.py": "from cpctl.runtime import step\n",
            "cpctl/runtime/step.py": "def later():\n    from cpctl.integrations import hf\n"}
    assert upward_imports(import_graph(write(tmp_path, tree))) == [("cpctl.runtime.step", "cpctl.integrations.hf")]


# ------------------------------------------------------------------------------- the runtime's door


def class_members(path: Path, class_name: str) -> set[str]:
    """Names a class declares: annotated fields, methods and properties."""
    tree = ast.parse(path.read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    names = {node.target.id for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return names | {node.name for node in body if isinstance(node, ast.FunctionDef)}


def members_called_on_runtime(path: Path) -> set[str]:
    """`runtime.x` and `self.runtime.x` in a module: what it uses of the runtime handed to it."""

    def is_runtime(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "runtime") or (
            isinstance(node, ast.Attribute) and node.attr == "runtime"
            and isinstance(node.value, ast.Name) and node.value.id == "self")

    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and is_runtime(node.value)}


def test_the_hugging_face_integration_sees_the_runtime_through_runtime_view() -> None:
    integrations = REPO / "cpctl" / "integrations"
    view = class_members(integrations / "runtime_view.py", "RuntimeView")
    used = members_called_on_runtime(integrations / "huggingface.py") | members_called_on_runtime(
        integrations / "hf_padding.py")
    assert used == view  # exactly what they use: nothing missing, nothing declared for nobody
    context = class_members(REPO / "cpctl" / "runtime" / "context.py", "StepContext")
    assert view - context == set()  # the step context the integration is handed is a RuntimeView


# Not documented: what integrations/accelerate_shim.py still calls on the Runtime it is handed,
# until it takes the step context and the model preparation instead.
def test_the_runtime_has_exactly_the_documented_members() -> None:
    documented = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        documented |= set(re.findall(r"\brt\.([a-z_]+)", page.read_text()))
    public = {name for name in class_members(REPO / "cpctl" / "runtime" / "runtime.py", "Runtime")
              if not name.startswith("_")}
    assert public == documented


def test_the_map_names_every_module() -> None:
    """A module added without its line on the map (docs/architecture.md) fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    unnamed = [str(path.relative_to(REPO)) for path in sorted((REPO / "cpctl").rglob("*.py"))
               if path.name not in ("__init__.py", "__main__.py") and path.name not in text]
    assert unnamed == []
