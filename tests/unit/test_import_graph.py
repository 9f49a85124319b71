"""The house's layout holds: imports only go down the floors (flows -> tasks -> sdpo_core, storage),
no module imports its way back to itself, and no module grows past the length CONTRIBUTING.md
allows. Every import counts, those inside functions and under TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "storage", "sdpo_core")
# what a floor may import: itself and the floors below (storage and sdpo_core are one floor apart
# from tasks, not from each other: the algorithm's verifiers and records never read the store)
ALLOWED = {
    "flows": {"flows", "tasks", "storage", "sdpo_core"},
    "tasks": {"tasks", "storage", "sdpo_core"},
    "storage": {"storage"},
    "sdpo_core": {"sdpo_core"},
}
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The product module an imported name belongs to (`a.b.c` may be a name in module `a.b`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        out |= {target for n in names if (target := _resolve(n, modules)) and target != module}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_imports_only_go_down_the_floors():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert upward == []


def test_no_module_imports_its_way_back_to_itself():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle through them
    edges = {m: {t for t in ts if not (t.startswith(m + ".") or m.startswith(t + "."))} for m, ts in graph.items()}
    circles, state = [], dict.fromkeys(edges, 0)

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state[target] == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif state[target] == 0:
                visit(target, [*path, target])
        state[node] = 2

    for module in sorted(edges):
        if state[module] == 0:
            visit(module, [module])
    assert circles == []


def test_no_module_is_past_the_length_the_guide_allows():
    long = {
        str(path.relative_to(REPO)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
