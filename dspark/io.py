"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark.errors import ResourceError


def ensure_writable_dir(path: Path) -> Path:
    """Create `path` (and parents) and prove we can write there, or raise one clear error."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        raise ResourceError(f"{path}: output directory is not writable ({e.strerror})") from None
    return path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    ensure_writable_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        tmp_path.chmod(0o644)
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def read_json_manifest(path: Path, *, missing_hint: str, version_key: str, version: int) -> dict:
    """A versioned JSON manifest, or a one-line DataError naming the file (and line)."""
    from dspark.errors import DataError

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing ({missing_hint})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON") from None
    if doc.get(version_key) != version:
        raise DataError(f"{path}: {version_key} {doc.get(version_key)!r}, expected {version}")
    return doc


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows of one shape (the first row's keys are the header), atomically."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, out.getvalue())


def write_json(path: Path, obj: object) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def disk_full(error: BaseException) -> bool:
    """Whether a write failed for want of space (safetensors' writer says so only in words)."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return "os error 28" in str(error) or "No space left on device" in str(error)


@contextmanager
def space_for(path: Path, needed: int) -> Iterator[None]:
    """Turn a full disk while writing `path` into one ResourceError naming the path and the
    bytes it needed; anything else passes through."""
    try:
        yield
    except Exception as e:
        if not disk_full(e):
            raise
        free = shutil.disk_usage(Path(path).parent).free
        raise ResourceError(
            f"{path}: no space left on the device ({needed:,} bytes to write, {free:,} free); "
            "free some and run the stage again: it resumes where it stopped"
        ) from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to the disk (a rename alone survives
    a killed process, not a lost machine: the renamed file may still be empty then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def old_name(path: Path) -> Path:
    """Where atomic_dir parks the folder it replaces, for the instant of the swap."""
    return path.with_name(f".{path.name}.old")


@contextmanager
def atomic_dir(
    path: Path, *, durable: bool = False, keep_previous: Path | None = None
) -> Iterator[Path]:
    """Build a directory under a temporary name; swap it into place only if the block succeeds.

    `durable`: every file, the folder and its parent reach the disk before and after the swap.
    `keep_previous`: the folder replaced moves there (over what was there) instead of going."""
    path = Path(path)
    ensure_writable_dir(path.parent)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp.chmod(0o755)
    try:
        yield tmp
        if durable:
            for f in tmp.rglob("*"):
                fsync_path(f)
            fsync_path(tmp)
        if path.exists():
            old = old_name(path)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            if keep_previous is not None:
                shutil.rmtree(keep_previous, ignore_errors=True)
                os.replace(old, keep_previous)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
