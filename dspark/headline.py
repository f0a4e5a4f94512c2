"""A pipeline run's headline figures, read from the stages' metrics files.

What a pipeline's parent run shows in the MLflow runs table, so that two runs compare without
opening their children. Pure: files in, two dicts out (the tracking code logs them).

    metrics                       from        what
    tau_mean.<method>             eval.json   mean over categories of tokens per verify step
                                              (every method but `none`, the plain target)
    lossless_mismatches           eval.json   checked decodes whose output differs from the target's
    speedup_c1.<mode>             bench.json  single-stream tok/s over the plain target's (`none`)
    tau_sim.<draft>               train.json  held-out acceptance length each trained draft reaches
    total_wall_s                  run.json    every stage's wall time, summed

    tags: profile and git_commit (run.json, else the first file holding them); cached_stages.

A file that is missing, unreadable or written for another profile contributes nothing: a stage
skipped as cached still has its file from the run that computed it, and contributes.
"""

from __future__ import annotations

import json
from pathlib import Path

FILES = {"train": "train.json", "eval": "eval.json", "bench": "bench.json", "run": "run.json"}
BASELINE_MODE = "none"  # the plain target: tau and speedup 1 by definition, so not headlines


def read_docs(folder: Path, profile: str | None = None) -> dict[str, dict]:
    """{"train"|"eval"|"bench"|"run": the parsed file} for those present in `folder` (written for
    `profile`, when given)."""
    docs = {}
    for key, name in FILES.items():
        try:
            doc = json.loads((Path(folder) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and (profile is None or doc.get("profile") == profile):
            docs[key] = doc
    return docs


def headline(docs: dict[str, dict]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) from `read_docs`' result."""
    metrics: dict[str, float] = {}
    ev, bench, train, run = (docs.get(k) or {} for k in ("eval", "bench", "train", "run"))
    for method, tau in (ev.get("mean") or {}).items():
        if method != BASELINE_MODE:
            _put(metrics, f"tau_mean.{method}", tau)
    lossless = ev.get("lossless")
    mismatches = lossless.get("mismatches") if isinstance(lossless, dict) else None
    _put(metrics, "lossless_mismatches", ev.get("lossless_mismatches", mismatches))
    for mode, row in (bench.get("overall") or {}).items():
        if mode != BASELINE_MODE and isinstance(row, dict):
            _put(metrics, f"speedup_c1.{mode}", row.get("speedup_c1"))
    for draft, block in train.items():
        if isinstance(block, dict) and "tau_sim" in block:
            _put(metrics, f"tau_sim.{draft}", block["tau_sim"])
    _put(metrics, "total_wall_s", run.get("total_wall_s"))

    tags: dict[str, str] = {}
    for key in ("profile", "git_commit"):
        value = next((d[key] for d in (run, ev, bench, train) if d.get(key)), None)
        if value:
            tags[key] = str(value)
    stages = run.get("stages") or {}
    if any(isinstance(s, dict) and "cached" in s for s in stages.values()):
        tags["cached_stages"] = ",".join(n for n, s in stages.items() if s.get("cached")) or "-"
    return metrics, tags


def _put(out: dict[str, float], key: str, value) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        out[key] = float(value)
