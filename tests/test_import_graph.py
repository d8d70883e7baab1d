"""The package's import graph, read from the sources with `ast` (nothing is imported here).

(a) No import circle between modules of `epoverlap` (every import statement counts, those
    inside functions too; only `if TYPE_CHECKING:` blocks, which never run, are left out).
(b) The layers import downward only. From the bottom: errors, kernels, data, parallel, config,
    model, schedule, graphs, profiling, training, simulator, cli; then `epoverlap/train.py` and
    `epoverlap/__init__.py` on top. A module of layer i imports layers <= i only (type-only
    imports count here: they tie the lower layer to the upper one all the same).
(c) Nothing under `epoverlap/` imports `benchmarks` or `tests`.
(d) No module under `epoverlap/` is longer than MAX_LINES lines.
(e) `epoverlap/training/` is rooms: every module sits in a subpackage (its `__init__` aside),
    none holding more than MAX_ROOM_FILES files.

Each failure names the modules and the import line (file:line: statement).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "epoverlap"
LAYERS = ("errors", "kernels", "data", "parallel", "config", "model", "schedule", "graphs",
          "profiling", "training", "simulator", "cli")
TOP = "top"  # epoverlap/__init__.py and epoverlap/train.py: above every layer
TOP_MODULES = ("epoverlap", "epoverlap.train")
MAX_LINES = 600
MAX_ROOM_FILES = 12



@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module of epoverlap (or the foreign top-level name)
    where: str  # "epoverlap/x/y.py:12: from ... import ..."
    type_only: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else \
                test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for statement in node.body:
                    inside.update(id(child) for child in ast.walk(statement))
    return inside


def _resolve(base: str, name: str) -> str:
    """`from base import name`: the submodule base.name if there is one, else base."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


def _imports_of(module: str, path: Path) -> list[Import]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    lines = text.splitlines()
    type_only = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [_resolve(base, alias.name) for alias in node.names]
        else:
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: " \
                f"{lines[node.lineno - 1].strip()}"
        for target in dict.fromkeys(targets):
            found.append(Import(module, target, where, id(node) in type_only))
    return found


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports_of(module, path)]
INTERNAL = [imp for imp in IMPORTS if imp.target.split(".")[0] == "epoverlap"]


def layer_of(module: str) -> str | None:
    if module in TOP_MODULES:
        return TOP
    name = module.split(".")[1]
    return name if name in LAYERS else None


def _rank(layer: str) -> int:
    return len(LAYERS) if layer == TOP else LAYERS.index(layer)


def _known_target(target: str) -> str:
    """The module an import names, or its nearest enclosing module (`import a.b.c` of a name
    that is not a module, an attribute through a package)."""
    while target not in MODULES and "." in target:
        target = target.rpartition(".")[0]
    return target


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a circle (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_sources_are_read():
    """The walk sees the package (a wrong root would make every other test vacuous)."""
    assert {"epoverlap", "epoverlap.errors", "epoverlap.config", "epoverlap.training.loop.trainer",
            "epoverlap.cli.train"} <= set(MODULES)
    assert any(imp.source == "epoverlap.train" and imp.target == "epoverlap.cli.train"
               for imp in INTERNAL)


def test_no_import_circle_between_modules():
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for imp in INTERNAL:
        if imp.type_only:
            continue
        target = _known_target(imp.target)
        if target != imp.source:
            edges.setdefault(imp.source, set()).add(target)
            lines.setdefault((imp.source, target), imp.where)
    problems = []
    for component in _cycles(edges):
        members = set(component)
        links = [lines[(a, b)] for a in component for b in sorted(edges.get(a, ()))
                 if b in members]
        problems.append(f"circle among {', '.join(component)}:\n    " + "\n    ".join(links))
    assert not problems, "import circles:\n" + "\n".join(problems)


def _upward() -> list[str]:
    problems = []
    for imp in INTERNAL:
        source_layer, target_layer = layer_of(imp.source), layer_of(_known_target(imp.target))
        if source_layer is None or target_layer is None:
            continue  # test_every_module_has_a_layer names these
        if _rank(target_layer) > _rank(source_layer):
            problems.append(f"{imp.source} (layer {source_layer}) imports "
                            f"{imp.target} (layer {target_layer}): {imp.where}")
    return problems


def test_every_module_has_a_layer():
    orphans = [module for module in MODULES if layer_of(module) is None]
    assert not orphans, (f"modules in no layer (layers: {', '.join(LAYERS)}; top: "
                         f"{', '.join(TOP_MODULES)}): {orphans}")


def test_layers_import_downward_only():
    problems = _upward()
    assert not problems, "imports of a higher layer:\n" + "\n".join(problems)


def test_nothing_in_the_package_imports_benchmarks_or_tests():
    problems = [f"{imp.source} imports {imp.target}: {imp.where}" for imp in IMPORTS
                if imp.target.split(".")[0] in ("benchmarks", "tests")]
    assert not problems, "\n".join(problems)


def _long_modules() -> list[str]:
    counts = {module: len(path.read_text(encoding="utf-8").splitlines())
              for module, path in MODULES.items()}
    return [f"{MODULES[module].relative_to(PACKAGE.parent)}: {count} lines"
            for module, count in sorted(counts.items()) if count > MAX_LINES]


def test_no_module_is_longer_than_the_limit():
    long = _long_modules()
    assert not long, f"modules over {MAX_LINES} lines: " + "; ".join(long)


def test_training_is_rooms_of_at_most_the_limit():
    training = PACKAGE / "training"
    loose = [path.name for path in training.glob("*.py") if path.name != "__init__.py"]
    rooms = {room.name: len(list(room.glob("*.py"))) for room in training.iterdir()
             if (room / "__init__.py").is_file()}
    assert not loose, f"modules of epoverlap/training/ outside a room: {loose}"
    assert len(rooms) > 1, f"rooms of epoverlap/training/: {rooms}"
    big = {room: count for room, count in rooms.items() if count > MAX_ROOM_FILES}
    assert not big, f"rooms over {MAX_ROOM_FILES} files: {big}"
