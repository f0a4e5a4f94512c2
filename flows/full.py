"""Flow `dspark`, deployment `full`: every stage in order, one MLflow parent run over them.

The profile is written into params.yaml first (the file `dvc repro` reproduces), then each stage
runs through DVC: after the flow, `dvc status` is clean and `dvc repro` has nothing to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from dspark import pipeline
from dspark.config import load_params
from dspark.errors import ConfigError
from dspark.headline import read_docs, read_table, summary
from dspark.io import write_text
from dspark.metrics import git_commit
from flows.stages import STAGE_FLOWS
from tasks.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]


def set_profile(params_file: Path, profile: str) -> None:
    """Make `profile` the file's active profile, touching only that line."""
    load_params(params_file, profile=profile)  # validate before writing
    pipeline.check_profile_sections(params_file)
    text = params_file.read_text()
    new, n = re.subn(r"^profile:[^\n#]*", f"profile: {profile}", text, count=1, flags=re.M)
    if n != 1:
        raise ConfigError(f"{params_file}: profile: no top-level `profile:` line to set")
    if new != text:
        write_text(params_file, new)


@flow(name="dspark", log_prints=True)
def dspark(profile: str = "default", root: str = str(ROOT)) -> dict:
    """The whole chain for `profile` in the repo at `root`."""
    logger = get_run_logger()
    root_path = Path(root)
    params_file = root_path / "params.yaml"
    set_profile(params_file, profile)
    params = load_params(params_file)
    tracker = Tracker(params, root_path)
    parent = tracker.start(
        f"dspark-{profile}",
        tags={
            "profile": profile,
            "git_commit": git_commit(root_path),
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
            "pipeline": "full",
        },
    )
    tracker.params(parent, params.flat())
    results, ok = {}, False
    try:
        for stage in pipeline.STAGES:
            results[stage.name] = STAGE_FLOWS[stage.name](profile, parent, str(root_path))
            logger.info("%s: %s", stage.name, "cached" if results[stage.name]["cached"] else "ran")
        pipeline.write_run_summary(root_path, profile, {k: v["cached"] for k, v in results.items()})
        # The headline figures, cached stages' included (their files are from the run that made
        # them): two pipeline runs compare in the runs table without opening their children.
        tracker.headline(parent, (root_path / pipeline.RUN_SUMMARY).parent, profile)
        tracker.artifact(parent, root_path / pipeline.RUN_SUMMARY)
        runs_page = tracker.ui_url()
        if runs_page:
            logger.info("MLflow: %s (this run: %s)", runs_page, tracker.ui_url(parent))
        mlflow = runs_page or (
            f"mlflow server --backend-store-uri {tracker.client.tracking_uri} "
            "--host 127.0.0.1 --port 5000 --workers 1, then http://127.0.0.1:5000"
        )
        docs = read_docs((root_path / pipeline.RUN_SUMMARY).parent, profile)
        full_dir = pipeline.FULL_DIR
        full = None if profile == "full" else (full_dir, read_table(root_path / full_dir))
        logger.info("%s", summary(docs, mlflow, profile, full=full))
        ok = True
    finally:
        tracker.finish(parent, ok)
    return {"mlflow_run_id": parent, "stages": {k: v["cached"] for k, v in results.items()}}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="run flow `dspark` once, in process")
    ap.add_argument("--profile", default="default")
    dspark(profile=ap.parse_args().profile)
