"""Shared fixtures: a tiny random target built once per session, and temporary repo copies."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Never reach for a hub from a test, and fail fast if something tries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One JSON object a line: prompt files, as the CLI and the stages read them."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dvc_metrics_show(files: dict[str, dict]) -> list[str]:
    """The lines `dvc metrics show` prints for these metrics files ({path: parsed file}),
    rendered by DVC's own table code as its CLI calls it (5 digits, rounded)."""
    from dvc.compare import show_metrics

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        data = {path: {"data": doc} for path, doc in files.items()}
        show_metrics({"workspace": {"data": data}}, precision=5, round_digits=True)
    return out.getvalue().splitlines()


def under_ci() -> bool:
    """Whether this is CI: `CI` set to anything but empty, 0, false or no (CI=true here)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """A prerequisite is missing: skip here, but fail under CI, which must provide it. The one
    way a test of this suite skips (tests/unit/test_layering.py holds it to that), so a run
    under CI=true has run every test, and `-ra` lists whatever a run elsewhere skipped."""
    if under_ci():
        pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


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


class SmallDisk:
    """A tmpfs of a given size mounted at `path` (root only): a disk that fills for real."""

    def __init__(self, path: Path):
        self.path = path

    def mount(self, size_bytes: int) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        size = f"size={max(4096, size_bytes)}"
        mounted = os.path.ismount(self.path)
        opts = f"remount,{size}" if mounted else size
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(self.path)], check=True)
        return self.path

    def unmount(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        skip_or_fail("mounting a small filesystem needs root and mount(8)")
    disk = SmallDisk(tmp_path / "small-disk")
    yield disk
    disk.unmount()


def tool_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


# --- Nothing left running ------------------------------------------------------------------
# Every process the suite starts inherits this variable: the PID of the pytest process that
# runs the test (an xdist worker's own, in a worker). At the end of the session, whatever still
# carries it was left behind by a test, in whatever session it put itself and even orphaned:
# it is reported, killed, and fails the run. An xdist worker hands its findings to the
# controller (which starts no test process itself, only the workers, which carry its PID).
OWNER_ENV = "DSPARK_TEST_OWNER"
# How long a process on its way out (a daemon finishing its write) gets to go.
LEFT_WAIT_S = float(os.environ.get("DSPARK_TEST_LEFT_WAIT_S", "15"))
LEFT_KEY = pytest.StashKey[list]()


def pytest_configure(config):
    os.environ[OWNER_ENV] = str(os.getpid())


# Helpers Python's multiprocessing starts for this process itself (torch uses them): each
# exits when its pipe from this process closes, i.e. with the pytest process, not before.
OWN_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def started_here() -> list[int]:
    """Live processes (not zombies) this pytest process's tests started, from /proc."""
    want = f"{OWNER_ENV}={os.getpid()}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            started = want in (d / "environ").read_bytes().split(b"\0")
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            helper = int(ppid) == os.getpid() and any(
                h in (d / "cmdline").read_bytes() for h in OWN_HELPERS
            )
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours
        if started and not helper and state != "Z" and int(d.name) != os.getpid():
            found.append(int(d.name))
    return found


def left_behind(wait: float = LEFT_WAIT_S) -> list[str]:
    """What the tests left running, after `wait` seconds for it to exit; killed, and said."""
    deadline = time.monotonic() + wait
    while (left := started_here()) and time.monotonic() < deadline:
        time.sleep(0.5)
    said = []
    for pid in left:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        said.append(f"{pid}: {cmd.strip()[:200]} (in {cwd})")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return said


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist, on the controller: a worker's findings
    output = getattr(node, "workeroutput", None) or {}
    node.config.stash.setdefault(LEFT_KEY, []).extend(output.get("left_behind", []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller reports
        config.workeroutput["left_behind"] = left_behind()
        return
    if config.pluginmanager.has_plugin("dsession"):  # the xdist controller
        left = config.stash.get(LEFT_KEY, [])
    else:
        left = left_behind()
    if left:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", "processes the tests left running (now killed)", red=True)
            for line in left:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
