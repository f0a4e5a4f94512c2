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


def test_every_metrics_file_is_a_stages_or_named_by_a_page():
    """metrics/ holds what the stages write, the full profile's run, the sweeps' tables and the
    GPU checks; any other file there (a study's output) is named by the page that tells its
    story, or it has no business being kept."""
    from dspark import stages

    written = {s.metrics for s in stages.STAGES}
    written |= {stages.RUN_SUMMARY, stages.EVAL_REPORT, stages.BENCH_REPORT}
    pages = "\n".join(p.read_text() for p in doc_files())
    kept = ("metrics/full/", "metrics/sweeps/", "metrics/gpu/")
    orphans = [
        rel
        for f in sorted((ROOT / "metrics").rglob("*"))
        if f.is_file()
        and (rel := f.relative_to(ROOT).as_posix()) not in written
        and not rel.startswith(kept)
        and f.name not in pages
    ]
    assert orphans == [], "named by no page in README.md, CHANGELOG.md or docs/"
