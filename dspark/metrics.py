"""The metrics convention, and the step-metrics log a stage writes while it runs.

Every metrics/*.json carries `profile`, `git_commit` and `created_at`; the tracking edge
(tasks/tracking.py) sends the same numbers to MLflow. Step-wise metrics go to a JSONL event log
beside the stage's outputs so the edge can follow it live without the library knowing MLflow.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dspark.io import write_json

# What the pipeline itself writes into tracked files: not a sign of uncommitted code or config.
PIPELINE_OUTPUTS = (":!metrics", ":!plots", ":!dvc.lock")


def git_commit(repo: Path | str = ".") -> str:
    """HEAD's SHA, with '-dirty' when tracked code or config differ; 'unknown' outside a
    checkout. The pipeline's own outputs (metrics, plots, dvc.lock) do not count."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *PIPELINE_OUTPUTS],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


# The instruction sets a CPU speed figure depends on (oneDNN and MKL pick kernels by them).
SPEED_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU a speed figure was measured on: its model, cores and the SPEED_FLAGS it has."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {"model": "unknown", "cores": os.cpu_count(), "flags": []}
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    have = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", "unknown"),
        "cores": os.cpu_count(),
        "flags": [f for f in SPEED_FLAGS if f in have],
    }


def cpu_seconds() -> float:
    """CPU time (user + system, every thread) of this process and of every child it has waited
    for: what a stage spent on the cores, its producers, servers and ranks included."""
    own, waited = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def stamp(profile: str, payload: dict[str, Any], repo: Path | str = ".") -> dict[str, Any]:
    return {
        "profile": profile,
        "git_commit": git_commit(repo),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **payload,
    }


def write_metrics(path: Path, profile: str, payload: dict[str, Any]) -> dict[str, Any]:
    doc = stamp(profile, payload)
    write_json(path, doc)
    return doc


class EventLog:
    """Append-only JSONL of step metrics: {"step": n, "time": t, "metrics": {...}}."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def log(self, step: int, **metrics: float) -> None:
        if not self.path:
            return
        line = json.dumps({"step": step, "time": time.time(), "metrics": metrics})
        with self.path.open("a") as f:
            f.write(line + "\n")


def read_events(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete lines from byte `offset` on, and the offset after the last complete one."""
    path = Path(path)
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end
