"""The evaluate stage's checkpoint: every decode's outcome, appended as soon as it finishes.

A rerun with the same fingerprint (params, target, drafts, prompts and the decoding code) replays
what is recorded instead of decoding it again, timings included, so a long evaluation that is
stopped goes on where it stopped. A different fingerprint starts a new record and drops the old.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from dspark.decode.engine import RowTrace, Timing
from dspark.io import write_text

CODE = ("decode", "evaluate", "models")


def fingerprint(basis: dict, files: list[Path]) -> str:
    """sha256 over a JSON basis, the files' contents and the decoding code."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode())
    code = sorted(p for sub in CODE for p in pkg.glob(f"{sub}/*.py"))
    for path in [*files, *code]:
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


def trace_fields(trace: RowTrace, timing: Timing) -> dict:
    return {"trace": asdict(trace), "timing": asdict(timing)}


def from_fields(rec: dict) -> tuple[RowTrace, Timing]:
    return RowTrace(**rec["trace"]), Timing(**rec["timing"])
