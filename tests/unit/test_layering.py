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
