"""Hidden-state shards on disk: the offline mode, and the cache of the hybrid one.

One safetensors file per shard holds each sample's tensors under `<sample_id>/<name>`;
`manifest.json` (written last, atomically) lists every sample with its shard and the CRC32 of
each tensor, so a reader verifies what it loads. In online mode the same manifest is written
with no shards: a receipt of what streamed through, and a DVC output the train stage depends on.

A long extraction checkpoints: every shard, once on disk, is also listed in `resume.json`, with
a fingerprint of what the states depend on. A writer opened later on the folder with the same
fingerprint keeps those shards and goes on after them (the samples it has are `resumed`, for
the stream to skip); another fingerprint starts over. Each shard's size and sha256 are listed
beside it, and an adopted shard that no longer matches (cut short, a byte flipped, gone) is
dropped with its samples, which the stream then extracts again. Closing replaces the file by
the manifest, which keeps the fingerprint: a finished extraction run again (DVC reruns it when
its code changes) keeps every shard. The manifest holds no timings, so the same states hash
the same.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from dspark.errors import DataError
from dspark.io import (
    atomic_path,
    ensure_writable_dir,
    read_json_manifest,
    sha256_file,
    space_for,
    write_json,
)
from dspark.schema import SCHEMA_VERSION, Sample
from dspark.transport.wire import crc32, verify

MANIFEST = "manifest.json"
RESUME = "resume.json"
log = logging.getLogger("dspark.extract")


class HiddenShardWriter:
    """`fingerprint`: what the states depend on; with one, a payload-keeping writer resumes
    what an earlier writer on the folder left (None: always start over)."""

    def __init__(
        self, folder: Path, *, shard_size: int, keep_payload: bool, fingerprint: str | None = None
    ):
        self.folder = ensure_writable_dir(Path(folder))
        self.shard_size = shard_size
        self.keep_payload = keep_payload
        self.fingerprint = fingerprint
        self.entries: list[dict] = []
        self.shard_files: dict[str, dict] = {}  # shard name -> {"bytes", "sha256"} as written
        self.attempts: list[dict] = []  # earlier writers' wall time and samples, oldest first
        self._pending: list[Sample] = []
        self._shards = 0
        self._t0 = time.monotonic()
        self._added = 0
        if fingerprint is not None and keep_payload:
            self._resume()
        if self.entries:
            self._checkpoint()  # before the manifest goes: a stop from here on keeps them
        else:
            (self.folder / RESUME).unlink(missing_ok=True)
        (self.folder / MANIFEST).unlink(missing_ok=True)
        kept = {e["shard"] for e in self.entries}
        for old in self.folder.glob("hidden-*.safetensors"):
            if old.name not in kept:  # an older run's, or written after the last checkpoint
                old.unlink()
        self.resumed = frozenset(e["sample_id"] for e in self.entries)

    def _resume(self) -> None:
        """Adopt what a stopped writer checkpointed, or what a finished one wrote."""
        for name in (RESUME, MANIFEST):
            try:
                doc = json.loads((self.folder / name).read_text())
            except (OSError, ValueError):
                continue  # absent, or from before the files were written atomically
            samples = doc.get("samples", [])
            shards = {e.get("shard") for e in samples}
            if (
                doc.get("fingerprint") == self.fingerprint
                and doc.get("payload", True)
                and all(isinstance(s, str) for s in shards)
            ):
                files = doc.get("shard_files") or {}
                bad = {name: why for name in shards if (why := self._damage(name, files.get(name)))}
                self.entries = [e for e in samples if e["shard"] not in bad]
                self.shard_files = {k: v for k, v in files.items() if k in shards and k not in bad}
                self.attempts = doc.get("attempts", [])
                kept = shards - set(bad)
                self._shards = 1 + max((shard_index(n) for n in kept), default=-1)
                if bad:
                    log.warning(
                        "extract: damaged shards dropped (%s); their %d samples are extracted "
                        "again",
                        "; ".join(f"{self.folder / n}: {why}" for n, why in sorted(bad.items())),
                        len(samples) - len(self.entries),
                    )
                return

    def _damage(self, name: str, written: dict | None) -> str | None:
        """Why the shard `name` is not what was written (None: it is). Shards listed before
        their sizes and checksums were have only their presence to check."""
        path = self.folder / name
        if not path.is_file():
            return "missing"
        if written is None:
            return None
        size = path.stat().st_size
        if size != written["bytes"]:
            return f"{size} bytes, {written['bytes']} written"
        if sha256_file(path) != written["sha256"]:
            return "checksum differs from the one written"
        return None

    def attempt(self) -> dict:
        """This writer's share so far: wall seconds since it opened, samples it added."""
        return {"wall_s": round(time.monotonic() - self._t0, 2), "samples": self._added}

    def add(self, sample: Sample, content: dict | None = None) -> None:
        """`content`: the sample's content fingerprints (dspark.extract.content), kept in its
        entry so that two manifests can be compared on what they hold."""
        entry = {
            "sample_id": sample.sample_id,
            "tokens": sample.num_tokens,
            "response_tokens": int(sample.loss_mask.sum()),
            "crc32": {k: crc32(t) for k, t in sample.tensors().items()},
            "shard": None,
        }
        if content is not None:
            entry["content"] = content
        self.entries.append(entry)
        self._added += 1
        if self.keep_payload:
            self._pending.append(sample)
            if len(self._pending) >= self.shard_size:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"hidden-{self._shards:05d}.safetensors"
        tensors = {
            f"{s.sample_id}/{k}": t.contiguous()
            for s in self._pending
            for k, t in s.tensors().items()
        }
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        with space_for(self.folder / name, needed), atomic_path(self.folder / name) as tmp:
            save_file(tensors, str(tmp))
            self.shard_files[name] = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
        done = {s.sample_id for s in self._pending}
        for e in self.entries:
            if e["sample_id"] in done:
                e["shard"] = name
        self._pending = []
        self._shards += 1
        if self.fingerprint is not None:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """List every shard on disk in `resume.json` (after the shard itself is in place)."""
        flushed = [e for e in self.entries if e["shard"] is not None]
        doc = {
            "fingerprint": self.fingerprint,
            "shards": sorted({e["shard"] for e in flushed}),
            "shard_files": dict(sorted(self.shard_files.items())),
            "attempts": self.all_attempts(),
            "samples": flushed,
        }
        with space_for(self.folder / RESUME, 0):
            write_json(self.folder / RESUME, doc)

    def all_attempts(self) -> list[dict]:
        """Every writer's share that reached a checkpoint, this one's so far last."""
        return [*self.attempts, self.attempt()]

    def close(self, extra: dict) -> dict:
        self._flush()
        doc = {
            "schema_version": SCHEMA_VERSION,
            "payload": self.keep_payload,
            "num_samples": len(self.entries),
            "fingerprint": self.fingerprint,
            **extra,
            "shard_files": dict(sorted(self.shard_files.items())),
            "samples": sorted(self.entries, key=lambda e: e["sample_id"]),
        }
        write_json(self.folder / MANIFEST, doc)
        (self.folder / RESUME).unlink(missing_ok=True)
        return doc


def shard_index(name: str) -> int:
    """hidden-00012.safetensors -> 12."""
    return int(name.removeprefix("hidden-").removesuffix(".safetensors"))


def read_hidden_manifest(folder: Path) -> dict:
    return read_json_manifest(
        Path(folder) / MANIFEST,
        missing_hint="run `dspark extract`",
        version_key="schema_version",
        version=SCHEMA_VERSION,
    )


def iter_hidden(folder: Path) -> Iterator[Sample]:
    """Every cached sample, CRC-verified, in sample-id order."""
    folder = Path(folder)
    doc = read_hidden_manifest(folder)
    if not doc["payload"]:
        raise DataError(f"{folder}: extracted online; no hidden states were kept on disk")
    for entry in sorted(doc["samples"], key=lambda e: e["sample_id"]):
        yield read_entry(folder, entry)


def read_entry(folder: Path, entry: dict) -> Sample:
    """One sample of the manifest, CRC-verified."""
    sid = entry["sample_id"]
    with safe_open(str(Path(folder) / entry["shard"]), framework="pt") as f:
        tensors = {k: f.get_tensor(f"{sid}/{k}") for k in entry["crc32"]}
    meta = {"sample_id": sid, "schema_version": SCHEMA_VERSION, "crc32": entry["crc32"]}
    return verify({"metadata": meta}, tensors)
