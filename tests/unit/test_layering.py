"""The library never imports Prefect or MLflow: orchestration and tracking stay at the edge."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "mlflow")


def test_no_edge_imports_in_source():
    offenders = []
    for path in (ROOT / "dspark").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n.split(".")[0] in (*FORBIDDEN, "tasks", "flows")
            ]
    assert offenders == []


def test_importing_every_module_loads_neither():
    code = (
        "import importlib, pkgutil, sys, dspark\n"
        "for m in pkgutil.walk_packages(dspark.__path__, 'dspark.'):\n"
        "    if m.name != 'dspark.__main__': importlib.import_module(m.name)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('prefect', 'mlflow')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def library_imports() -> dict[str, set[str]]:
    """module -> the library modules it imports, lazy imports inside functions included."""
    from dspark import codedeps

    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "dspark").rglob("*.py")
    }
    return {m: set(codedeps.imports_of_module(m)) - {m} for m in modules}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_library_imports_one_way():
    """No two library modules import each other, directly or round a longer loop: every import
    runs down, so a module can be read, tested and changed with only what it imports in mind."""
    assert import_circles(library_imports()) == []
