"""Shared fixtures: a tiny random target built once per session, and temporary repo copies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Never reach for a hub from a test, and fail fast if something tries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    from dspark.config import TargetConfig
    from dspark.models.target import materialize

    out = tmp_path_factory.mktemp("target") / "tiny"
    materialize(TargetConfig(model="tiny-random"), out)
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from dspark.models.target import load_target

    return load_target(tiny_target_dir)


@pytest.fixture(scope="session")
def smoke_params():
    from dspark.config import load_params

    return load_params(ROOT / "params.yaml", profile="smoke")


def copy_repo(dest: Path, profile: str | None = None) -> Path:
    """The working tree as git sees it (tracked + untracked, not ignored) in a fresh git repo."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for p in ("dvc.lock", "metrics"):  # the copy starts with no pipeline state of ours
        target = dest / p
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    if profile:
        text = (dest / "params.yaml").read_text()
        (dest / "params.yaml").write_text(
            text.replace("profile: default", f"profile: {profile}", 1)
        )
    git = ["git", "-c", "user.email=test@dspark", "-c", "user.name=test"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=dest, check=True)
    return dest


def tool_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env
