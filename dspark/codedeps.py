"""The library files a stage's code depends on, read from its imports.

A stage's DVC deps (and the fingerprint that decides whether its records resume) must name every
`dspark/` module the stage can run: a module left out is a change DVC never sees, and a default
changed in `config.py` would never rerun the stage. Written by hand, such lists drift; so they
are derived here from the import statements themselves, transitively, the lazy ones inside
functions included (they run when the stage does).

The reading is static (`ast`), so it sees every import a module spells out, and a string that is
exactly a library module's name counts as one too: that is how a module started in a subprocess
(`python -m dspark.train.rank`) is named. Code that imports by a computed name would hide from it;
tests/unit/test_codedeps.py checks the static reading against what a stage's imports really load.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

PACKAGE = "dspark"
ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the package


def module_path(name: str) -> Path | None:
    """`dspark.a.b` -> dspark/a/b.py or dspark/a/b/__init__.py (None for a name that is neither,
    such as a class imported with `from dspark.a import B`)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _named(tree: ast.AST, here: str) -> tuple[set[str], set[str]]:
    """The `dspark` modules that the code in `tree` imports, and those it runs by name (in a
    subprocess). `here` is the package that relative imports start from."""
    imported: set[str] = set()
    run: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                module = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            imported.add(module)
            # `from dspark.a import b` imports the submodule dspark.a.b where there is one.
            imported |= {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and str(node.value).startswith(f"{PACKAGE}."):
            run.add(str(node.value))  # `python -m dspark.x.y`

    def ours(names: set[str]) -> set[str]:
        return {n for n in names if n.split(".")[0] == PACKAGE and module_path(n)}

    return ours(imported), ours(run)


@cache
def _read(name: str) -> tuple[frozenset[str], frozenset[str]]:
    path = module_path(name)
    assert path is not None, name
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported, run = _named(ast.parse(path.read_text(), str(path)), here)
    return frozenset(imported), frozenset(run)


def imports_of_module(name: str) -> frozenset[str]:
    """The library modules a module imports, lazy imports inside functions included."""
    return _read(name)[0]


def _with_parents(name: str) -> set[str]:
    """Importing dspark.a.b runs dspark/__init__.py and dspark/a/__init__.py first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def closure(modules: Iterable[str]) -> list[str]:
    """Every `dspark` module that importing `modules` can load or start, as paths relative to
    the repo root, sorted; empty files left out."""
    seen: set[str] = set()
    todo = [m for name in modules for m in _with_parents(name)]
    while todo:
        name = todo.pop()
        if name in seen or module_path(name) is None:
            continue
        seen.add(name)
        imported, run = _read(name)
        for other in imported | run:
            todo += _with_parents(other)
    paths = [module_path(n) for n in seen]
    # An empty __init__.py holds no code to depend on (and DVC warns of an empty dep).
    return sorted(str(p.relative_to(ROOT)) for p in paths if p and p.stat().st_size)


def imports_of_function(fn: Callable) -> set[str]:
    """The `dspark` modules a function's body imports (a stage's runner imports lazily)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    imported, run = _named(tree, fn.__module__.rpartition(".")[0])
    return imported | run
