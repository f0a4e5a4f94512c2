"""The docs hold together: every relative link resolves, every quoted command exists.

Covers README.md, CHANGELOG.md and docs/**/*.md. A `dspark <subcommand>` is checked against the
CLI's own parser, a `make <target>` against the Makefile's rule lines. Nothing heavy is loaded:
building the parser imports the stage registry only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 260

LINK = re.compile(r"\[(?:[^\]\n]|\n(?!\n))*?\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
# Blocks that show output or data, not commands: a run's printed summary is ```text.
NOT_COMMANDS = {"text", "json", "yaml", "python"}
# A command at the start of a code span or a code-block line, optionally after a shell prompt.
DSPARK_CMD = re.compile(r"^(?:\$\s+)?(?:python -m )?dspark\s+([a-z][a-z0-9-]*)\b")
MAKE_CMD = re.compile(r"^(?:\$\s+)?make\s+([A-Za-z0-9_.-]+)\b")
MAKE_RULE = re.compile(r"^([A-Za-z0-9_.-]+):", re.M)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets that point into the repository: no scheme, no mailto, no bare anchor."""
    text = FENCE.sub("", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def commands(text: str) -> list[str]:
    """Code spans, and every line of every fenced block: where a command would be quoted."""
    spans = []
    for info, block in FENCE.findall(text):
        if info.strip() not in NOT_COMMANDS:
            spans += [line.strip() for line in block.splitlines()]
    spans += [m.strip() for m in INLINE_CODE.findall(FENCE.sub("", text))]
    return spans


def dspark_subcommands() -> set[str]:
    from dspark.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("dspark's parser has no subcommands")


def make_targets() -> set[str]:
    return set(MAKE_RULE.findall((ROOT / "Makefile").read_text()))


def test_the_files_exist():
    files = doc_files()
    assert all(p.is_file() for p in files)
    assert len(files) > 3, "docs/ has no pages"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    broken = [
        target
        for target in relative_links(path.read_text())
        if not (path.parent / target).resolve().exists()
    ]
    assert broken == [], f"{path.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_command_exists(path: Path):
    subcommands, targets = dspark_subcommands(), make_targets()
    unknown = []
    for span in commands(path.read_text()):
        if (m := DSPARK_CMD.match(span)) and m.group(1) not in subcommands:
            unknown.append(span)
        if (m := MAKE_CMD.match(span)) and m.group(1) not in targets:
            unknown.append(span)
    assert unknown == [], f"{path.relative_to(ROOT)}: unknown commands {unknown}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_checks_catch_what_they_should():
    """The parsers find a broken link and an unknown command (so the tests above can fail)."""
    text = (
        "See [a](docs/nowhere.md#x), [b](https://example.org), [c](#top), [d](mailto:a@b).\n"
        "Run `dspark no-such-stage --profile smoke` or `make no-such-target`; the package\n"
        "dspark is a library, and dspark/models holds `dspark/models/dspark.py`.\n"
        "```bash\ndspark train --profile default\nmake run\n```\n"
        "```text\ndspark default run\n```\n"
    )
    assert relative_links(text) == ["docs/nowhere.md"]
    spans = commands(text)
    found = [m.group(1) for s in spans if (m := DSPARK_CMD.match(s))]
    made = [m.group(1) for s in spans if (m := MAKE_CMD.match(s))]
    assert sorted(found) == ["no-such-stage", "train"]
    assert sorted(made) == ["no-such-target", "run"]
    assert "no-such-stage" not in dspark_subcommands()
    assert {"train", "evaluate", "benchmark", "standing"} <= dspark_subcommands()
    assert {"run", "test"} <= make_targets()


# metrics/'s layout: at the top, what the stages write (each stage's file, the run summary, the
# two reports) and these folders. One-off studies and the scripts of SCRIPT_FOLDERS write into
# studies/.
METRICS_FOLDERS = {
    "full": "the full profile's committed run, as it wrote metrics/",
    "sweeps": "the sweeps' tables (flows/sweep.py)",
    "gpu": "the GPU checks (infra/gpu/)",
    "studies": "one-off studies' and the scripts' (SCRIPT_FOLDERS) outputs, each named by its page",
    "headline": "the working profile's headline table (dspark.headline)",
}
STUDIES = "metrics/studies/"
# metrics/full/ beside the stages' files: the run's lock (what `dvc repro` ran) and where it
# stands (`dspark standing --out`), committed at each stop of a long run.
FULL_EXTRAS = ("dvc.lock", "standing.json")
# The scripts run by hand: draft-quality studies (evals/) and speed benchmarks (benchmarks/).
SCRIPT_FOLDERS = ("evals", "benchmarks")
# A metrics path as a script spells it: `metrics/x.json`, or ROOT / "metrics" / "x.json".
METRICS_PATH = re.compile(r"metrics/[\w./-]+\.(?:json|csv|md)")


def stage_outputs() -> set[str]:
    from dspark import pipeline

    written = {s.metrics for s in pipeline.STAGES}
    return written | {pipeline.RUN_SUMMARY, pipeline.EVAL_REPORT, pipeline.BENCH_REPORT}


def metrics_layout_problems(root: Path, pages: str, written: set[str]) -> list[str]:
    """What breaks the layout: a file no stage writes at the top or in full/, an unknown folder,
    a study output no page names by its path, a script of SCRIPT_FOLDERS whose output lands
    outside it."""
    problems = []
    for entry in sorted((root / "metrics").iterdir()):
        rel = entry.relative_to(root).as_posix()
        if entry.is_dir() and entry.name not in METRICS_FOLDERS:
            problems.append(f"{rel}/: not a folder of metrics/'s layout")
        elif entry.is_file() and rel not in written:
            problems.append(f"{rel}: no stage writes it (a study's output goes in {STUDIES})")
    for entry in sorted((root / "metrics/full").glob("*")):
        rel = entry.relative_to(root).as_posix()
        if (
            entry.is_file()
            and entry.name not in FULL_EXTRAS
            and f"metrics/{entry.name}" not in written
        ):
            problems.append(f"{rel}: no stage writes it (a study's output goes in {STUDIES})")
    for f in sorted((root / STUDIES).rglob("*")):
        if f.is_file() and (rel := f.relative_to(root).as_posix()) not in pages:
            problems.append(f"{rel}: named by no page in README.md, CHANGELOG.md or docs/")
    kept = tuple(f"metrics/{name}/" for name in METRICS_FOLDERS if name != "headline")
    scripts = sorted(p for folder in SCRIPT_FOLDERS for p in (root / folder).glob("*.py"))
    for script in scripts:
        text = re.sub(r'"\s*/\s*"', "/", script.read_text())  # "metrics" / "x" -> "metrics/x"
        for path in METRICS_PATH.findall(text):
            if path not in written and not path.startswith(kept):
                problems.append(f"{script.relative_to(root)}: writes {path} (not in {STUDIES})")
    return problems


def test_metrics_holds_the_stages_files_and_named_studies():
    """metrics/ top level holds what the stages write, and the folders of METRICS_FOLDERS; a
    study's output sits in metrics/studies/, named by the page that tells its story."""
    pages = "\n".join(p.read_text() for p in doc_files())
    assert metrics_layout_problems(ROOT, pages, stage_outputs()) == []


def test_the_layout_check_catches_a_stray_file(tmp_path):
    """A study's file at the top, an unnamed one in studies/, an unknown folder and a script
    writing beside the stages' files are each caught; what the layout allows is not."""
    for rel in ("metrics/eval.json", "metrics/full/eval.json", "metrics/studies/told.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    for folder in SCRIPT_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "good.py").write_text(
            'OUT = ROOT / "metrics" / "studies" / "a.json"\n'
        )
    written, pages = {"metrics/eval.json"}, "see `metrics/studies/told.json`"
    assert metrics_layout_problems(tmp_path, pages, written) == []

    (tmp_path / "metrics/study.json").write_text("{}")
    (tmp_path / "metrics/full/walk.json").write_text("{}")
    (tmp_path / "metrics/bench").mkdir()
    (tmp_path / "metrics/studies/untold.json").write_text("{}")
    bad = '"""Writes metrics/x.json."""\nOUT = ROOT / "metrics" / "y.json"\n'
    (tmp_path / "evals/bad.py").write_text(bad)
    (tmp_path / "benchmarks/bad.py").write_text('OUT = ROOT / "metrics/headline/z.json"\n')
    found = metrics_layout_problems(tmp_path, pages, written)
    assert [p.split(":")[0] for p in found] == [
        "metrics/bench/",
        "metrics/study.json",
        "metrics/full/walk.json",
        "metrics/studies/untold.json",
        "benchmarks/bad.py",
        "evals/bad.py",
        "evals/bad.py",
    ]
