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
