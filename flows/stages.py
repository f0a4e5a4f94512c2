"""One Prefect flow per registered stage, derived from dspark.pipeline.STAGES."""

from __future__ import annotations

from prefect import flow

from dspark.pipeline import STAGES
from tasks.repro import repro_stage


def _stage_flow(name: str):
    @flow(name=name, log_prints=True)
    def stage_flow(profile: str, parent_run_id: str, root: str) -> dict:
        return repro_stage(name, profile, parent_run_id, root)

    stage_flow.__doc__ = f"Stage `{name}`: run through DVC, recorded in MLflow."
    return stage_flow


STAGE_FLOWS = {s.name: _stage_flow(s.name) for s in STAGES}
