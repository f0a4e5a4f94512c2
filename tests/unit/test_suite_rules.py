"""Rules the suite holds itself to: every skip goes through `skip_or_fail`, which fails under
CI (so a CI run has run every test), and .ci/run declares CI itself."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The ways pytest can skip a test: a call, a marker, a conditional marker, a guarded import.
SKIPS = re.compile(r"pytest\.skip\(|importorskip\(|mark\.skip\b|mark\.skipif\b|pytest\.xfail\(")


def test_every_skip_goes_through_the_one_helper():
    helper = ROOT / "tests" / "conftest.py"
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SKIPS.search(line) and not (path == helper and "allow_module_level" in line)
    ]
    assert found == []


def test_ci_declares_itself_wherever_it_runs():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^export CI=true$", script, re.M)
    assert script.index("export CI=true") < script.index("make test")


def _rule(makefile: str, target: str) -> tuple[str, str]:
    """(prerequisites, recipe) of a Makefile rule."""
    m = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", makefile, re.M)
    assert m, f"no rule {target!r} in the Makefile"
    return m.group(1), m.group(2)


def test_the_llamacpp_tier_is_deselected_by_ci_and_run_by_its_own_target():
    """CI does not build .venv-llamacpp (it compiles llama.cpp, longer than CI can spare): `make
    test` deselects marker `llamacpp` (pytest counts them as deselected, never as skipped), and
    `make test-llamacpp` builds the venv and runs exactly them. A module that uses the real venv
    carries the marker, and one that carries it uses the venv, so CI runs every other test."""
    makefile = (ROOT / "Makefile").read_text()
    needs, recipe = _rule(makefile, "test")
    assert "llamacpp-venv" not in needs
    assert re.findall(r'-m "([^"]*)"', recipe) == ["not llamacpp"]
    needs, recipe = _rule(makefile, "test-llamacpp")
    assert "llamacpp-venv" in needs.split() and re.search(r"-m llamacpp\b", recipe)
    assert '"llamacpp:' in (ROOT / "pyproject.toml").read_text()  # registered: strict markers
    uses, marked = set(), set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        text, rel = path.read_text(), str(path.relative_to(ROOT))
        if '".venv-llamacpp"' in text:
            uses.add(rel)
        if re.search(r"pytestmark = \[[^\]]*pytest\.mark\.llamacpp\b", text):
            marked.add(rel)
    assert uses == marked == {"tests/integration/test_llamacpp.py"}
