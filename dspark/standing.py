"""Where a long run stands: each stage finished, part-way (from the checkpoint it resumes from),
or not started, read from the files the stages leave in a checkout. Pure reading: nothing here
runs or changes a stage.

    stage      finished when                 part-way from
    extract    artifacts/hidden/manifest.json artifacts/hidden/resume.json (shards on disk)
    train      metrics/train.json            artifacts/checkpoints/train/state.json
    evaluate   metrics/eval.json             artifacts/eval_records/*.jsonl (decodes recorded)
    benchmark  metrics/bench.json            artifacts/bench_records/*.jsonl (cells recorded)
    others     metrics/<stage>.json          -

A stage is finished when its metrics file was written for the profile asked about (a checkout
switches profiles) after its checkpoint last changed (a checkpoint may outlive the run that
finished it; a rerun rewrites it first).
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark import stages


def _json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _lines(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in sorted(folder.glob("*.jsonl")))


def _mtime(path: Path) -> float:
    """Newest modification time of a file, or of the files in a folder (0: none)."""
    if path.is_dir():
        return max((_mtime(p) for p in path.iterdir()), default=0.0)
    return path.stat().st_mtime if path.exists() else 0.0


def _extract(root: Path) -> dict | None:
    resume = _json(root / stages.HIDDEN / "resume.json")
    if resume is None:
        return None
    shards = _json(root / stages.SHARDS / "manifest.json") or {}
    samples = resume.get("samples", [])
    return {
        "samples": len(samples),
        "of": shards.get("num_samples"),
        "tokens": sum(e.get("tokens", 0) for e in samples),
        "response_tokens": sum(e.get("response_tokens", 0) for e in samples),
        "attempts": len(resume.get("attempts", [])),
        "wall_s": round(sum(a.get("wall_s", 0.0) for a in resume.get("attempts", [])), 1),
    }


def _train(root: Path) -> dict | None:
    state = _json(root / stages.TRAIN_CHECKPOINT / "state.json")
    if state is None:
        return None
    return {
        "step": state.get("step"),
        "epoch": state.get("epoch"),
        "tokens": state.get("tokens"),
        "wall_s": round(state.get("loop_s", 0.0), 1),
        "tau_sim": {
            name: (run.get("last_eval") or {}).get("tau_sim")
            for name, run in (state.get("runs") or {}).items()
        },
    }


def _records(folder: Path, what: str) -> dict | None:
    if not folder.is_dir() or not any(folder.glob("*.jsonl")):
        return None
    return {what: _lines(folder)}


def standing(root: Path, profile: str) -> dict:
    """{stage: {"state": "finished" | "part-way" | "not started", ...}} for `profile`."""
    root = Path(root)
    partial = {  # stage -> (what its checkpoint says, where the checkpoint is)
        "extract": (lambda: _extract(root), stages.HIDDEN),
        "train": (lambda: _train(root), stages.TRAIN_CHECKPOINT),
        "evaluate": (lambda: _records(root / stages.EVAL_RECORDS, "records"), stages.EVAL_RECORDS),
        "benchmark": (
            lambda: _records(root / stages.BENCH_RECORDS, "records"),
            stages.BENCH_RECORDS,
        ),
    }
    out = {}
    for stage in stages.STAGES:
        read, where = partial.get(stage.name, (lambda: None, None))
        part = read()
        done = _json(root / stage.metrics)
        if done is not None and done.get("profile") != profile:
            done = None
        if part is not None and (
            done is None or _mtime(root / where) > _mtime(root / stage.metrics)
        ):
            out[stage.name] = {"state": "part-way", **part}
        elif done is not None:
            out[stage.name] = {
                "state": "finished",
                "wall_s": done.get("wall_s"),
                "git_commit": done.get("git_commit"),
            }
        else:
            out[stage.name] = {"state": "not started"}
    return out


def render(report: dict) -> str:
    """One line per stage."""
    lines = []
    for name, row in report.items():
        rest = ", ".join(f"{k} {v}" for k, v in row.items() if k != "state" and v is not None)
        lines.append(f"{name:<10} {row['state']}{': ' + rest if rest else ''}")
    return "\n".join(lines)
