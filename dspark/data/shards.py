"""Token shards: the prepare stage's output, the extract stage's input.

One safetensors file per shard holds its samples concatenated:
    input_ids   [T] int32      T = tokens in the shard
    loss_mask   [T] bool       True on response tokens
    offsets     [N+1] int64    sample i is input_ids[offsets[i]:offsets[i+1]]
    sample_ids  [N] int64      global, dense, in order: the stream's exactly-once key
with the prompt ids in the file's metadata. `manifest.json` is written last, atomically: a folder
without it is a run still in progress (and resumable), never a finished one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.errors import DataError
from dspark.io import atomic_path, read_json_manifest, write_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TokenSample:
    sample_id: int
    prompt_id: str
    input_ids: torch.Tensor  # [S] int32
    loss_mask: torch.Tensor  # [S] bool

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape or self.input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {list(self.input_ids.shape)} and loss_mask "
                f"{list(self.loss_mask.shape)} must be equal 1-D shapes"
            )


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(
    path: Path, samples: list[TokenSample], *, regenerated: int, fingerprint: str
) -> dict:
    """Write one shard atomically; return its manifest entry."""
    lengths = torch.tensor([0] + [s.input_ids.numel() for s in samples], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to(torch.bool) for s in samples]),
        "offsets": torch.cumsum(lengths, 0),
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
    }
    meta = {
        "format_version": str(FORMAT_VERSION),
        "prompt_ids": json.dumps([s.prompt_id for s in samples]),
        "regenerated": str(regenerated),
        "fingerprint": fingerprint,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return shard_entry(path)


def shard_entry(path: Path) -> dict:
    """A finished shard's line in the manifest, computed from the file itself."""
    samples, meta = read_shard(path, with_meta=True)
    return {
        "file": path.name,
        "samples": len(samples),
        "tokens": sum(s.input_ids.numel() for s in samples),
        "response_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
        "regenerated": int(meta.get("regenerated", 0)),
        "fingerprint": meta.get("fingerprint", ""),
        "first_sample_id": samples[0].sample_id,
        "sha256": file_sha256(path),
    }


def read_shard(path: Path, with_meta: bool = False):
    """The samples of one shard (and its metadata when `with_meta`)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets", "sample_ids")}
    except FileNotFoundError:
        raise DataError(f"{path}: no such shard") from None
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise DataError(f"{path}: not a readable shard ({e})") from None
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise DataError(
            f"{path}: shard format {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    prompt_ids = json.loads(meta.get("prompt_ids", "[]"))
    offsets = t["offsets"].tolist()
    if len(offsets) != len(prompt_ids) + 1 or offsets[-1] != t["input_ids"].numel():
        raise DataError(f"{path}: offsets do not match its tokens")
    samples = [
        TokenSample(int(sid), pid, t["input_ids"][a:b], t["loss_mask"][a:b])
        for sid, pid, a, b in zip(
            t["sample_ids"].tolist(), prompt_ids, offsets[:-1], offsets[1:], strict=True
        )
    ]
    return (samples, meta) if with_meta else samples


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, entries: list[dict], extra: dict) -> dict:
    doc = {
        "format_version": FORMAT_VERSION,
        "num_samples": sum(e["samples"] for e in entries),
        "num_tokens": sum(e["tokens"] for e in entries),
        "response_tokens": sum(e["response_tokens"] for e in entries),
        "regenerated": sum(e["regenerated"] for e in entries),
        **extra,
        "shards": entries,
    }
    write_json(Path(folder) / MANIFEST, doc)
    return doc


def read_manifest(folder: Path) -> dict:
    return read_json_manifest(
        Path(folder) / MANIFEST,
        missing_hint="run `dspark prepare`, or it has not finished",
        version_key="format_version",
        version=FORMAT_VERSION,
    )


def iter_samples(folder: Path, verify: bool = True) -> Iterator[TokenSample]:
    """Every sample of a finished shard folder, in sample-id order."""
    folder = Path(folder)
    for entry in read_manifest(folder)["shards"]:
        path = folder / entry["file"]
        if verify and file_sha256(path) != entry["sha256"]:
            raise DataError(f"{path}: checksum differs from {MANIFEST}")
        yield from read_shard(path)
