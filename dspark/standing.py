"""Where a long run stands: each stage finished, part-way (from the checkpoint it resumes from),
or not started, read from the files the stages leave in a checkout. Pure reading: nothing here
runs or changes a stage.

    stage      finished when                 part-way from
    extract    artifacts/hidden/manifest.json artifacts/hidden/resume.json (shards on disk)
    train      metrics/train.json            artifacts/checkpoints/train/state.json
    evaluate   metrics/eval.json             artifacts/eval_records/*.jsonl (decodes recorded)
    benchmark  metrics/bench.json            artifacts/bench_records/*.jsonl (cell rounds recorded)
    others     metrics/<stage>.json          -

A stage is finished when its metrics file was written for the profile asked about (a checkout
switches profiles; DVC deletes the file when it reruns the stage) and its checkpoint, which may
outlive the run that finished it, agrees: extract's manifest is written and no resume.json is
left; train's checkpoint is at the step its metrics report. A finished stage also shows its
headline figures (held-out tau_sim per draft, mean tau per method, single-stream speedups).
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark import pipeline


def _json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _lines(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in sorted(folder.glob("*.jsonl")))


def _extract(root: Path) -> dict | None:
    resume = _json(root / pipeline.HIDDEN / "resume.json")
    if resume is None:
        return None
    shards = _json(root / pipeline.SHARDS / "manifest.json") or {}
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
    state = _json(root / pipeline.TRAIN_CHECKPOINT / "state.json")
    if state is None:
        return None
    last = {name: run.get("last_eval") or {} for name, run in (state.get("runs") or {}).items()}
    out = {
        "step": state.get("step"),
        "epoch": state.get("epoch"),
        "tokens": state.get("tokens"),
        "wall_s": round(state.get("loop_s", 0.0), 1),
        "tau_sim": {name: ev.get("tau_sim") for name, ev in last.items()},
    }
    return {**out, **_optional(last)}


def _optional(drafts: dict[str, dict]) -> dict:
    """The held-out figures older code did not record, where the drafts have them."""
    out = {}
    for key in ("tau_greedy", "tau_decode"):
        found = {name: d[key] for name, d in drafts.items() if d.get(key) is not None}
        if found:
            out[key] = found
    return out


def _records(folder: Path, what: str) -> dict | None:
    if not folder.is_dir() or not any(folder.glob("*.jsonl")):
        return None
    return {what: _lines(folder)}


def _figures(stage: str, done: dict) -> dict:
    """A finished stage's headline figures, as its metrics file names them."""
    if stage == "extract":
        keys = ("tokens", "onpolicy_tok_s")  # (a resumed run's samples_received: its last part)
        return {k: done[k] for k in keys if k in done}
    if stage == "train":
        drafts = {name: run for name, run in done.items() if isinstance(run, dict)}
        taus = {name: run["tau_sim"] for name, run in drafts.items() if "tau_sim" in run}
        out = {"steps": done.get("steps"), "tokens": done.get("tokens"), "tau_sim": taus}
        return {**out, **_optional(drafts)}
    if stage == "evaluate":
        return {"mean_tau": done.get("mean")}
    if stage == "benchmark":
        overall = done.get("overall") or {}
        return {"speedup_c1": {m: row.get("speedup_c1") for m, row in overall.items()}}
    return {}


def standing(root: Path, profile: str) -> dict:
    """{stage: {"state": "finished" | "part-way" | "not started", ...}} for `profile`."""
    root = Path(root)
    partial = {  # stage -> what its checkpoint says
        "extract": lambda: _extract(root),
        "train": lambda: _train(root),
        "evaluate": lambda: _records(root / pipeline.EVAL_RECORDS, "records"),
        "benchmark": lambda: _records(root / pipeline.BENCH_RECORDS, "records"),
    }
    out = {}
    for stage in pipeline.STAGES:
        part = partial[stage.name]() if stage.name in partial else None
        done = _json(root / stage.metrics)
        if done is not None and done.get("profile") != profile:
            done = None
        if stage.name == "extract" and not (root / pipeline.HIDDEN / "manifest.json").is_file():
            done = None  # a rerun under way, before its first shard
        if stage.name == "train" and part is not None and done is not None:
            done = done if done.get("steps") == part["step"] else None
        if done is None and part is not None:
            out[stage.name] = {"state": "part-way", **part}
        elif done is not None:
            out[stage.name] = {
                "state": "finished",
                "wall_s": done.get("wall_s"),
                **({"cpu_s": done["cpu_s"]} if "cpu_s" in done else {}),
                "git_commit": done.get("git_commit"),
                **_figures(stage.name, done),
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
