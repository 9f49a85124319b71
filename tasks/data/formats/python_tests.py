"""What an assert-style suite (HumanEval, MBPP) takes from an answer and what it brings itself.

The sandbox runs such a suite's test code in a namespace of the judge's own builtins, the suite's
setup and only the suite's entry points from the answer (`sdpo_core.verifiers.code.TestSuite`). So
preparation decides those names here: the entry point the problem statement asks for, and the
reference definitions of the helpers the prompt shows (HumanEval's `poly`, `encode_cyclic`, ...),
which go into the setup instead of being taken from the answer.
"""

from __future__ import annotations

import ast
import builtins
import sys

from tasks.data.rows import BadRow

__all__ = ["called_entry_points", "missing_imports", "prompt_helpers"]


def _parse(source: str, what: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise BadRow(f"{what} is not valid Python ({exc.msg}, line {exc.lineno})") from None


def prompt_helpers(prompt: str, entry_point: str) -> str:
    """The prompt's code without the definition of `entry_point`: its imports and the helpers it
    defines, which the tests may call (BadRow when the prompt does not define `entry_point`)."""
    tree = _parse(prompt, "the prompt")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            assert node.end_lineno is not None
            lines = prompt.splitlines()
            return "\n".join(lines[: first - 1] + lines[node.end_lineno :]).strip()
    raise BadRow(f"the prompt defines no function {entry_point!r} (the entry point)")


def _bound(tree: ast.AST) -> set[str]:
    """Names a piece of code binds: assignments, definitions, imports, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _loaded(tree: ast.AST) -> list[str]:
    """Names a piece of code reads, in order of first use."""
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            seen.setdefault(node.id, None)
    return list(seen)


def called_entry_points(tests: list[str], setup: str, reference: str | None) -> list[str]:
    """The names MBPP-style `tests` take from the answer: those the reference solution defines at
    its top level (a builtin's name too, as MBPP's `sum`), else the names the tests read but neither
    they, the setup nor the builtins bind. BadRow when there are none, or when the setup itself
    needs a name the answer defines (objects of the answer's own classes cannot reach the judge)."""
    test_trees = [_parse(test, f"test {i + 1}") for i, test in enumerate(tests)]
    setup_tree = _parse(setup, "the test setup code")
    read = [name for tree in test_trees for name in _loaded(tree)]
    read = list(dict.fromkeys(read))
    defined: set[str] = set()
    if reference is not None:
        try:
            reference_tree = ast.parse(reference)
        except SyntaxError:
            reference_tree = None
        if reference_tree is not None:
            defined = {
                node.name
                for node in reference_tree.body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
    names = [name for name in read if name in defined]
    if not names:
        bound = set().union(*(_bound(tree) for tree in test_trees), _bound(setup_tree), dir(builtins))
        names = [name for name in read if name not in bound and name not in sys.stdlib_module_names]
    if not names:
        raise BadRow("cannot tell which function the tests call (no name they read is the answer's)")
    needed = [name for name in _loaded(setup_tree) if name in defined and name not in _bound(setup_tree)]
    if needed:
        raise BadRow(
            f"the test setup builds objects of the answer's own {needed} before the tests run; only plain "
            "values pass between the judge and the answer"
        )
    return names


def missing_imports(tests: list[str], setup: str, entry_points: list[str]) -> list[str]:
    """Standard-library modules the tests use without importing them (MBPP's `math.isclose`, which
    its own harness took from the answer's imports): the setup imports them instead."""
    setup_bound = _bound(_parse(setup, "the test setup code"))
    modules: dict[str, None] = {}
    for i, test in enumerate(tests):
        tree = _parse(test, f"test {i + 1}")
        for name in _loaded(tree):
            if name in sys.stdlib_module_names and name not in _bound(tree) | setup_bound | set(entry_points):
                modules.setdefault(name, None)
    return list(modules)
