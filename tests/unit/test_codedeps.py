"""A stage's code deps are every library module it can run: read from the imports, checked
against what the imports really load, and mutation-checked so a stale list cannot pass."""

import json
import subprocess
import sys

import pytest

from dspark import codedeps
from dspark.pipeline import STAGES, get

LOADED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "dspark")))
"""


def loaded_files(modules: set[str]) -> set[str]:
    """The library files a fresh interpreter holds after importing `modules`."""
    out = subprocess.run(
        [sys.executable, "-c", LOADED, *sorted(modules)], capture_output=True, text=True, check=True
    )
    paths = (codedeps.module_path(m) for m in json.loads(out.stdout))
    # An empty package __init__ holds no code: the deps leave it out.
    return {str(p.relative_to(codedeps.ROOT)) for p in paths if p is not None and p.stat().st_size}


def undeclared(stage_code: tuple[str, ...], loaded: set[str]) -> list[str]:
    return sorted(loaded - set(stage_code))


def test_train_runs_the_config_and_the_shards_module():
    # The two misses that motivated deriving the lists: a default in config.py, and shards.py.
    code = get("train").code
    assert {"dspark/config.py", "dspark/data/shards.py", "dspark/train/trainer.py"} <= set(code)
    assert all(c.startswith("dspark/") and c.endswith(".py") for c in code)


def test_every_stage_names_config_and_what_its_runner_imports():
    for stage in STAGES:
        assert "dspark/config.py" in stage.code, stage.name
        for name in codedeps.imports_of_function(stage.run):
            assert str(codedeps.module_path(name).relative_to(codedeps.ROOT)) in stage.code


def test_lazy_relative_and_spawned_imports_are_followed(tmp_path, monkeypatch):
    pkg = tmp_path / "dspark"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "sub" / "__init__.py").write_text("")  # empty: no code to depend on
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from dspark.c import Thing\n")
    (pkg / "c.py").write_text('import os\nThing = 1\nCMD = ["-m", "dspark.spawned"]\n')
    (pkg / "spawned.py").write_text("print(1)\n")  # run in a subprocess by its name
    (pkg / "unused.py").write_text('"""Not dspark.unused itself: only an exact name counts."""\n')
    monkeypatch.setattr(codedeps, "ROOT", tmp_path)
    codedeps._read.cache_clear()
    try:
        got = codedeps.closure({"dspark.sub.a"})
    finally:
        codedeps._read.cache_clear()
    assert got == [
        "dspark/__init__.py",
        "dspark/c.py",
        "dspark/spawned.py",
        "dspark/sub/a.py",
        "dspark/sub/b.py",
    ]


@pytest.mark.parametrize("stage", [s.name for s in STAGES])
def test_what_a_stage_imports_at_run_time_is_in_its_deps(stage):
    """The static reading against the interpreter: everything importing the runner's modules
    loads is named. And the check can tell: drop one loaded module from the list and it says so
    (the mutation a hand-kept list suffers)."""
    s = get(stage)
    loaded = loaded_files(codedeps.imports_of_function(s.run))
    assert undeclared(s.code, loaded) == []
    dropped = sorted(loaded - {"dspark/__init__.py"})[-1]
    assert undeclared(tuple(c for c in s.code if c != dropped), loaded) == [dropped]


def test_no_module_is_imported_by_a_computed_name():
    """A computed import would hide from the static reading."""
    offenders = [
        str(p.relative_to(codedeps.ROOT))
        for p in (codedeps.ROOT / "dspark").rglob("*.py")
        if "import_module(" in p.read_text() or "__import__(" in p.read_text()
    ]
    assert offenders == []


def test_train_resumes_only_on_the_code_dvc_hashes_for_it():
    # train/stage.py's checkpoint fingerprint reads the same closure as the stage's DVC deps.
    assert codedeps.closure({"dspark.train.stage", "dspark.config"}) == list(get("train").code)
