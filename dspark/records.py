"""A long stage's checkpoint: outcomes appended to a JSONL file as soon as each one finishes.

A rerun with the same fingerprint (what decides the outcomes: params, inputs and code) reads
them back instead of computing them again, so a stopped stage goes on where it stopped. A
different fingerprint starts a new file and drops the old one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dspark.io import write_text

PKG = Path(__file__).resolve().parent


def code_files(deps: tuple[str, ...]) -> list[Path]:
    """The library's own files among a stage's DVC deps (`dspark/...`, a package or a module):
    the code its records depend on, the same files DVC hashes for the stage."""
    files: list[Path] = []
    for dep in deps:
        if dep.startswith("dspark/"):
            path = PKG.parent / dep
            files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def fingerprint(basis: dict, files: list[Path], deps: tuple[str, ...]) -> str:
    """sha256 over a JSON basis, the input files' contents and the code among `deps`."""
    h = hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode())
    for path in [*files, *code_files(deps)]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


class Records:
    def __init__(self, folder: Path, fp: str):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.jsonl"):
            if old.stem != fp:
                old.unlink()
        self.path = folder / f"{fp}.jsonl"
        self.done: dict[str, dict] = {}
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by the stop: everything before it stands
                self.done[rec["key"]] = rec
                kept.append(line)
            write_text(self.path, "".join(f"{line}\n" for line in kept))
        self.replayed = 0  # records of an earlier run read back (each counted once)
        self._earlier = set(self.done)

    def get(self, key: str) -> dict | None:
        rec = self.done.get(key)
        if key in self._earlier:
            self._earlier.discard(key)
            self.replayed += 1
        return rec

    def put(self, key: str, **fields) -> dict:
        rec = {"key": key, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.done[key] = rec
        return rec

    def clear(self) -> None:
        """Drop the record: the stage it checkpointed has finished."""
        self.path.unlink(missing_ok=True)
        self.done.clear()
