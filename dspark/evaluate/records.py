"""The evaluate stage's records (dspark.records): every decode's outcome, timings included,
keyed by prompt and method. The fingerprint covers the code the stage's DVC deps name (passed
down as `EvalPaths.code`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from dspark import records
from dspark.decode.decoder import RowTrace, Timing
from dspark.records import Records

__all__ = ["Records", "fingerprint", "from_fields", "trace_fields"]


def fingerprint(basis: dict, files: list[Path], code: tuple[str, ...]) -> str:
    """Over the basis, the input files and the library code among `code` (the stage's deps)."""
    return records.fingerprint(basis, files, code)


def trace_fields(trace: RowTrace, timing: Timing) -> dict:
    return {"trace": asdict(trace), "timing": asdict(timing)}


def from_fields(rec: dict) -> tuple[RowTrace, Timing]:
    return RowTrace(**rec["trace"]), Timing(**rec["timing"])
