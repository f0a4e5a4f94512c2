"""One stage, run through `dvc repro` (so Prefect and DVC agree) and recorded in MLflow."""

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
def repro_stage(name: str, profile: str, parent_run_id: str, root: str) -> dict:
    root_path = Path(root)
    logger = get_run_logger()
    stage = pipeline.get(name)
    params = load_params(root_path / "params.yaml", profile=profile)
    record = StageRecord(Tracker(params, root_path), stage, profile, root_path, parent_run_id)
    record.log_params(params)
    ok = False
    try:
        rc, out = repro(stage, root_path, logger, record.follow)
        how = skipped(name, out) if rc == 0 else None
        cached = how is not None
        if how == "run-cache":  # the restored metrics are another run's
            (root_path / stage.events).unlink(missing_ok=True)
        if rc != 0:
            tail = " | ".join(out.strip().splitlines()[-3:])
            raise RuntimeError(f"stage {name} failed (dvc repro exit {rc}): {tail}")
        doc = json.loads((root_path / stage.metrics).read_text())
        record.outcome(doc, cached)
        if stage.register and not cached:
            record.register(logger)
        if stage.report and (root_path / stage.report).is_file():
            create_markdown_artifact(
                markdown=(root_path / stage.report).read_text(),
                key=f"{name}-report",
                description=f"{name} ({profile} profile)",
            )
        ok = True
        return {"stage": name, "cached": cached, "run_id": record.run_id, "metrics": doc}
    finally:
        record.finish(ok)


def repro(stage: pipeline.Stage, root: Path, logger, follow) -> tuple[int, str]:
    """`dvc repro` of the stage alone, `follow` called on every tick to pass its events on.

    The stage's events are this run's only: the last run's are set aside, and put back if DVC
    finds the stage unchanged (its metrics then are still that run's) or if the run never got
    going. No `dvc status` first: it cost a DVC start (2-4 s) per stage."""
    events = root / stage.events
    aside = events.with_name(events.name + ".last")
    if events.exists():
        events.replace(aside)
    try:
        return dvc(
            ["repro", "--single-item", stage.name],
            root,
            on_line=logger.info,
            every=follow,
            grace=stage.stop_grace_s,
        )
    finally:
        if aside.exists() and not events.exists():
            aside.replace(events)  # unchanged, or stopped before the stage wrote any
        aside.unlink(missing_ok=True)


class StageRecord:
    """A stage's MLflow run, and a child run per draft beside it in the UI, fed from the stage's
    events as it runs and from its metrics when it ends."""

    def __init__(
        self, tracker: Tracker, stage: pipeline.Stage, profile: str, root: Path, parent: str
    ) -> None:
        self.tracker, self.stage, self.profile, self.root = tracker, stage, profile, root
        self.run_id = tracker.start(
            stage.name,
            parent=parent,
            tags={
                "stage": stage.name,
                "profile": profile,
                "git_commit": git_commit(root),
                "prefect.flow_run_id": str(flow_run.get_id() or ""),
            },
        )
        self.children: dict[str, str] = {}  # draft name -> its child run
        self._offset = 0  # how far into the events file follow() has read
        self._lock = threading.Lock()  # follow() runs on the runner's ticker thread and here

    def log_params(self, params) -> None:
        """The params the stage depends on (its dvc.yaml params sections), flattened."""
        keys = self.stage.params
        self.tracker.params(
            self.run_id,
            {
                k: v
                for k, v in params.flat().items()
                if any(k == p or k.startswith(p + ".") for p in keys)
            },
        )

    def child(self, draft: str) -> str:
        with self._lock:
            if draft not in self.children:
                self.children[draft] = self.tracker.start(
                    draft,
                    parent=self.run_id,
                    tags={
                        "stage": self.stage.name,
                        "draft": draft,
                        "profile": self.profile,
                        "git_commit": git_commit(self.root),
                    },
                )
            return self.children[draft]

    def follow(self) -> None:
        """Pass on the events the stage wrote since the last call, each draft's to its child."""
        with self._lock:
            events, self._offset = read_events(self.root / self.stage.events, self._offset)
        for e in events:
            own, routed = split_by_child(e["metrics"], self.stage.children)
            ts = int(e["time"] * 1000)
            self.tracker.metrics(self.run_id, own, step=e["step"], timestamp_ms=ts)
            for draft, values in routed.items():
                self.tracker.metrics(self.child(draft), values, step=e["step"], timestamp_ms=ts)

    def outcome(self, doc: dict, cached: bool) -> None:
        """The stage's metrics, its lineage tags and artifacts, and each draft's summary."""
        name, root = self.stage.name, self.root
        self.tracker.metrics(self.run_id, doc)
        self.tracker.tags(
            self.run_id, {"cached": str(cached).lower(), **dvc_lock_hashes(root, name)}
        )
        self.tracker.artifact(self.run_id, root / self.stage.metrics)
        for rel in (self.stage.resolved, *self.stage.artifacts):
            self.tracker.artifact(self.run_id, root / rel)
        # Each draft's summary goes beside its step metrics under final/, so MLflow's latest
        # value of a step metric stays the last step's.
        # Train keeps each draft's summary at the top level, evaluate under "overall".
        summaries = doc.get("overall") if isinstance(doc.get("overall"), dict) else doc
        for draft in self.stage.children:
            if isinstance(summaries.get(draft), dict):
                final = {k: v for k, v in summaries[draft].items() if k != "curve"}
                self.tracker.metrics(self.child(draft), {"final": final})
        for variant, values in (doc.get("markov_ablation") or {}).items():
            draft = "dspark" if variant == "vanilla" else f"dspark_{variant}"
            self.tracker.metrics(self.child(draft), {"final": values})

    def register(self, logger) -> None:
        """The stage's model folder as a new version in MLflow's registry, when it exists."""
        who, folder, model_name = self.stage.register
        if not (self.root / folder).is_dir():
            return
        version = self.tracker.register(
            self.child(who),
            self.root / folder,
            model_name,
            tags={
                "profile": self.profile,
                "git_commit": git_commit(self.root),
                **dvc_lock_hashes(self.root, self.stage.name),
            },
        )
        logger.info("registered %s version %s", model_name, version)

    def finish(self, ok: bool) -> None:
        for child_id in self.children.values():
            self.tracker.finish(child_id, ok)
        self.tracker.finish(self.run_id, ok)


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
