"""MLflow at the edge: one parent run per pipeline run, one nested child run per stage.

Uses MlflowClient with explicit run ids (not the fluent, thread-local active run), so it behaves
the same inside Prefect's task threads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from dspark.config import Params
from dspark.headline import headline, read_docs

PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
# How MLflow marks a model-training experiment, as opposed to a GenAI one (3.17's JS bundle: the
# experiment tag `mlflow.experimentKind`, enum value CUSTOM_MODEL_DEVELOPMENT, labelled "Machine
# learning"; mlflow/demo sets "genai_development" the same way).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# 3.17's UI ignores that tag while its GenAI / "Model training" switch is on (the bundle hard-codes
# it on): the switch, `?workflowType=` in the URL, else the browser's last choice (default GenAI),
# picks the page. Links we print carry it, so a fresh browser lands on the runs table.
UI_QUERY = "?workflowType=machine_learning"
# A view of the runs table with the headline figures as columns (3.17 shows none by default): the
# UI reads `?viewStateShareKey=K` from the experiment tag `mlflow.sharedViewState.K`, plain JSON.
HEADLINE_VIEW = "headline"
SHARED_VIEW_TAG = "mlflow.sharedViewState."
MAX_BATCH = 900


def tracking_uri(params: Params, root: Path) -> str:
    """MLFLOW_TRACKING_URI, else params' store; a relative sqlite path is from the repo root."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.mlflow_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        uri = prefix + str((root / uri[len(prefix) :]).resolve())
    return uri


class Tracker:
    def __init__(self, params: Params, root: Path):
        self.root = root
        self.client = MlflowClient(tracking_uri=tracking_uri(params, root))
        exp = self.client.get_experiment_by_name(params.tracking.experiment)
        if exp is None:
            location = (root / params.tracking.artifact_root).resolve().as_uri()
            self.experiment_id = self.client.create_experiment(
                params.tracking.experiment,
                artifact_location=location,
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        else:
            self.experiment_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # made before the tag
                self.client.set_experiment_tag(
                    self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND
                )

    def ui_url(self, run_id: str | None = None) -> str | None:
        """The MLflow UI's page for the experiment's runs (or one run), where the tracking URI is
        a server's; None for a local store (serve it, then open the same path)."""
        uri = self.client.tracking_uri
        if not uri.startswith(("http://", "https://")):
            return None
        if run_id:
            return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}{UI_QUERY}"
        tags = self.client.get_experiment(self.experiment_id).tags
        view = (
            f"&viewStateShareKey={HEADLINE_VIEW}" if SHARED_VIEW_TAG + HEADLINE_VIEW in tags else ""
        )
        return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs{UI_QUERY}{view}"

    def start(self, name: str, tags: dict[str, str], parent: str | None = None) -> str:
        tags = {RUN_NAME_TAG: name, **tags}
        if parent:
            tags[PARENT_TAG] = parent
        return self.client.create_run(self.experiment_id, tags=tags, run_name=name).info.run_id

    def params(self, run_id: str, values: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def metrics(
        self, run_id: str, values: dict[str, Any], step: int = 0, timestamp_ms: int | None = None
    ) -> None:
        import time

        ts = timestamp_ms or int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in _numbers(values).items()]
        for i in range(0, len(items), MAX_BATCH):
            self.client.log_batch(run_id, metrics=items[i : i + MAX_BATCH])

    def tags(self, run_id: str, values: dict[str, str]) -> None:
        items = [RunTag(k, str(v)) for k, v in values.items()]
        if items:
            self.client.log_batch(run_id, tags=items)

    def artifact(self, run_id: str, path: Path, folder: str | None = None) -> None:
        if Path(path).is_file():
            self.client.log_artifact(run_id, str(path), artifact_path=folder)

    def register(self, run_id: str, folder: Path, model_name: str, tags: dict[str, str]) -> str:
        """Log `folder` under the run and register it as a new version of `model_name`."""
        from mlflow.exceptions import MlflowException

        self.client.log_artifacts(run_id, str(folder), artifact_path="draft")
        try:
            self.client.create_registered_model(model_name)
        except MlflowException as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/draft"
        version = self.client.create_model_version(
            model_name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()}
        )
        return str(version.version)

    def headline(self, run_id: str, metrics_dir: Path, profile: str | None = None) -> dict:
        """Log the pipeline's headline figures (dspark.headline) on its parent run, from the
        metrics files in `metrics_dir`, so runs compare in the runs table; return the metrics."""
        metrics, tags = headline(read_docs(metrics_dir, profile))
        self.metrics(run_id, metrics)
        self.tags(run_id, tags)
        if metrics:
            columns = [f"tags.`{k}`" for k in ("profile", "git_commit")]
            columns += [f"metrics.`{k}`" for k in metrics]
            self.client.set_experiment_tag(
                self.experiment_id,
                SHARED_VIEW_TAG + HEADLINE_VIEW,
                json.dumps({"selectedColumns": columns}),
            )
        return metrics

    def finish(self, run_id: str, ok: bool) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def _numbers(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten nested dicts; keep real numbers (bools and strings are tags, not metrics)."""
    out: dict[str, float] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_numbers(v, key + "."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[key] = v
    return out


def dvc_lock_hashes(root: Path, stage: str) -> dict[str, str]:
    """The DVC hashes of a stage's dependencies, from dvc.lock, as tags."""
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage, {})
    tags = {}
    for dep in entry.get("deps", []):
        digest = dep.get("md5") or dep.get("hash") or ""
        tags[f"dvc.dep.{dep['path']}"] = digest
    for out in entry.get("outs", []):
        tags[f"dvc.out.{out['path']}"] = out.get("md5") or out.get("hash") or ""
    params = entry.get("params")
    if params:
        tags["dvc.params_sha256"] = _sha(json.dumps(params, sort_keys=True, default=str))
    return tags


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]
