"""One stage, run through DVC (so Prefect and `dvc repro` agree) and recorded in MLflow."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from dspark import pipeline
from dspark.config import load_params
from dspark.metrics import git_commit, read_events
from tasks import proc
from tasks.tracking import Tracker, dvc_lock_hashes

BIN = Path(sys.executable).parent


def tool_env() -> dict[str, str]:
    """The environment's own executables (dvc, dspark) first on PATH."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def dvc(args: list[str], root: Path, **kwargs) -> tuple[int, str]:
    return proc.run([str(BIN / "dvc"), *args], cwd=root, env=tool_env(), **kwargs)


def skipped(name: str, out: str) -> str | None:
    """How `dvc repro --single-item NAME` left the stage unrun, from DVC's own lines for it (a
    stage's command may print anything): "unchanged", "run-cache" (outputs restored from an
    earlier run with the same inputs), or None when it ran."""
    for line in out.splitlines():
        if line.startswith(f"Stage '{name}' didn't change, skipping"):
            return "unchanged"
        if line.startswith(f"Stage '{name}' is cached - skipping run"):
            return "run-cache"
    return None


@task(name="stage", task_run_name="{name}")
def run_stage(name: str, profile: str, parent_run_id: str, root: str) -> dict:
    root_path = Path(root)
    logger = get_run_logger()
    stage = pipeline.get(name)
    params = load_params(root_path / "params.yaml", profile=profile)
    tracker = Tracker(params, root_path)
    run_id = tracker.start(
        name,
        parent=parent_run_id,
        tags={
            "stage": name,
            "profile": profile,
            "git_commit": git_commit(root_path),
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
        },
    )
    keys = stage.params
    tracker.params(
        run_id,
        {
            k: v
            for k, v in params.flat().items()
            if any(k == p or k.startswith(p + ".") for p in keys)
        },
    )
    events_path = root_path / stage.events
    offset = 0
    children: dict[str, str] = {}  # draft name -> its child run, side by side in the UI
    lock = threading.Lock()  # follow() runs on the runner's ticker thread and once more here

    def child(draft: str) -> str:
        with lock:
            if draft not in children:
                children[draft] = tracker.start(
                    draft,
                    parent=run_id,
                    tags={
                        "stage": name,
                        "draft": draft,
                        "profile": profile,
                        "git_commit": git_commit(root_path),
                    },
                )
            return children[draft]

    def follow() -> None:
        nonlocal offset
        with lock:
            events, offset = read_events(events_path, offset)
        for e in events:
            own, routed = split_by_child(e["metrics"], stage.children)
            ts = int(e["time"] * 1000)
            tracker.metrics(run_id, own, step=e["step"], timestamp_ms=ts)
            for draft, values in routed.items():
                tracker.metrics(child(draft), values, step=e["step"], timestamp_ms=ts)

    ok = False
    # The stage's events are this run's only: the last run's are set aside, and put back if
    # DVC finds the stage unchanged (its metrics then are still that run's) or if the run never
    # got going. No `dvc status` first: it cost a DVC start (2-4 s) per stage.
    aside = events_path.with_name(events_path.name + ".last")
    if events_path.exists():
        events_path.replace(aside)
    try:
        try:
            rc, out = dvc(
                ["repro", "--single-item", name],
                root_path,
                on_line=logger.info,
                every=follow,
                grace=stage.stop_grace_s,
            )
        finally:
            if aside.exists() and not events_path.exists():
                aside.replace(events_path)  # unchanged, or stopped before the stage wrote any
            aside.unlink(missing_ok=True)
        how = skipped(name, out) if rc == 0 else None
        cached = how is not None
        if how == "run-cache":
            events_path.unlink(missing_ok=True)  # the restored metrics are another run's
        if rc != 0:
            tail = " | ".join(out.strip().splitlines()[-3:])
            raise RuntimeError(f"stage {name} failed (dvc repro exit {rc}): {tail}")
        doc = json.loads((root_path / stage.metrics).read_text())
        tracker.metrics(run_id, doc)
        tracker.tags(run_id, {"cached": str(cached).lower(), **dvc_lock_hashes(root_path, name)})
        tracker.artifact(run_id, root_path / stage.metrics)
        for rel in (stage.resolved, *stage.artifacts):
            tracker.artifact(run_id, root_path / rel)
        # Each draft's summary goes beside its step metrics under final/, so MLflow's latest
        # value of a step metric stays the last step's.
        # Train keeps each draft's summary at the top level, evaluate under "overall".
        summaries = doc.get("overall") if isinstance(doc.get("overall"), dict) else doc
        for draft in stage.children:
            if isinstance(summaries.get(draft), dict):
                final = {k: v for k, v in summaries[draft].items() if k != "curve"}
                tracker.metrics(child(draft), {"final": final})
        for variant, values in (doc.get("markov_ablation") or {}).items():
            draft = "dspark" if variant == "vanilla" else f"dspark_{variant}"
            tracker.metrics(child(draft), {"final": values})
        if stage.register and not cached:
            who, folder, model_name = stage.register
            if (root_path / folder).is_dir():
                version = tracker.register(
                    child(who),
                    root_path / folder,
                    model_name,
                    tags={
                        "profile": profile,
                        "git_commit": git_commit(root_path),
                        **dvc_lock_hashes(root_path, name),
                    },
                )
                logger.info("registered %s version %s", model_name, version)
        if stage.report and (root_path / stage.report).is_file():
            create_markdown_artifact(
                markdown=(root_path / stage.report).read_text(),
                key=f"{name}-report",
                description=f"{name} ({profile} profile)",
            )
        ok = True
        return {"stage": name, "cached": cached, "run_id": run_id, "metrics": doc}
    finally:
        for child_id in children.values():
            tracker.finish(child_id, ok)
        tracker.finish(run_id, ok)


def split_by_child(metrics: dict, names: tuple[str, ...]) -> tuple[dict, dict[str, dict]]:
    """{"dspark/loss": 1, "tokens": 9} -> ({"tokens": 9}, {"dspark": {"loss": 1}})."""
    own: dict = {}
    routed: dict[str, dict] = {}
    for key, value in metrics.items():
        prefix, sep, rest = key.partition("/")
        if sep and prefix in names:
            routed.setdefault(prefix, {})[rest] = value
        else:
            own[key] = value
    return own, routed
