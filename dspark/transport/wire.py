"""One sample on the wire: hs-connectors' packed layout plus our integrity fields.

The payload is the packed object hs-connectors (and vLLM's hidden-states connector on GPUs)
writes: every tensor at a 64-byte-aligned offset of one buffer. The manifest is theirs too
(`version`, `handle`, `tensors`, `metadata.total_aligned_bytes`), with our fields added under
`metadata`: the sample id, the schema version and a CRC32 per tensor. It travels on the control
channel after the payload is stored, and the consumer verifies every CRC before use.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from hs_connectors.mooncake_store import VERSION as HS_MANIFEST_VERSION
from hs_connectors.mooncake_store import packed_layout

from dspark.schema import SCHEMA_VERSION, Sample, SampleError


class CorruptSample(SampleError):
    """A payload whose bytes do not match its manifest's CRC32."""


def handle_for(run_id: str, sample_id: int, attempt: str = "0") -> str:
    return f"dspark/{run_id}/{sample_id}/{attempt}"


def crc32(tensor: torch.Tensor) -> int:
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy()) & 0xFFFFFFFF


def make_manifest(sample: Sample, handle: str) -> dict[str, Any]:
    tensors = sample.tensors()
    specs, total = packed_layout({k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})
    return {
        "version": HS_MANIFEST_VERSION,
        "handle": handle,
        "tensors": {k: {**v, "shape": list(v["shape"])} for k, v in specs.items()},
        "metadata": {
            "total_aligned_bytes": total,
            "sample_id": sample.sample_id,
            "schema_version": SCHEMA_VERSION,
            "crc32": {k: crc32(t) for k, t in tensors.items()},
        },
    }


def verify(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Sample:
    """CRC-check every tensor, then schema-check the sample. Raises CorruptSample/SampleError."""
    meta = manifest["metadata"]
    sample_id = int(meta["sample_id"])
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise SampleError(
            f"sample {sample_id}: schema {meta.get('schema_version')}, expected {SCHEMA_VERSION}"
        )
    for name, expected in meta["crc32"].items():
        if name not in tensors:
            raise CorruptSample(f"sample {sample_id}: tensor {name!r} missing")
        if crc32(tensors[name]) != expected:
            raise CorruptSample(f"sample {sample_id}: CRC32 mismatch in {name!r}")
    return Sample.from_tensors(sample_id, tensors)
