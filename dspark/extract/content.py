"""Content fingerprints of an extraction: two runs compared on what they extracted, apart from
how (attempts, timings, which producer took which sample, the shard layout).

    tokens         every sample's token ids and loss mask: the data itself
    states_exact   every captured tensor, bit for bit (the manifest's CRC32s)
    states_summary per sample and tapped layer, the mean and RMS of the states to SUMMARY_DIGITS
                   significant figures: equal where the states differ only by float noise (a
                   batch of another shape, another kernel), unequal where they differ in kind

Each sample's own three values go in its manifest entry (`content`), so two manifests can also
say which samples differ; the run's fingerprint is a hash over the samples in id order.
"""

from __future__ import annotations

import hashlib
import json
import zlib

import torch

from dspark.schema import Sample

SUMMARY_DIGITS = 3


def _crc(*tensors: torch.Tensor) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc & 0xFFFFFFFF


def _summary(states: torch.Tensor) -> list[str]:
    """[L, S, H] -> each layer's mean and RMS, to SUMMARY_DIGITS significant figures."""
    x = states.float()
    mean = x.mean(dim=(1, 2))
    rms = x.pow(2).mean(dim=(1, 2)).sqrt()
    return [
        f"{float(v):.{SUMMARY_DIGITS - 1}e}" for pair in zip(mean, rms, strict=True) for v in pair
    ]


def sample_content(sample: Sample) -> dict:
    """One sample's content: {"tokens": crc, "states_summary": crc} (the exact states' CRCs are
    the manifest entry's `crc32`)."""
    states = torch.cat((sample.aux_hidden, sample.last_hidden[None]), dim=0)  # [L+1, S, H]
    summary = ",".join(_summary(states)).encode()
    return {
        "tokens": _crc(sample.input_ids.to(torch.int64), sample.loss_mask.to(torch.uint8)),
        "states_summary": zlib.crc32(summary) & 0xFFFFFFFF,
    }


def fingerprints(entries: list[dict]) -> dict:
    """The run's fingerprints over its manifest entries (each with `crc32` and `content`);
    None for a part no entry carries (a manifest from before fingerprints)."""
    ordered = sorted(entries, key=lambda e: e["sample_id"])

    def digest(part) -> str | None:
        if not ordered or any(part(e) is None for e in ordered):
            return None
        text = json.dumps([[e["sample_id"], part(e)] for e in ordered], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {
        "samples": len(ordered),
        "tokens": digest(lambda e: (e.get("content") or {}).get("tokens")),
        "states_exact": digest(lambda e: e.get("crc32")),
        "states_summary": digest(lambda e: (e.get("content") or {}).get("states_summary")),
        "summary_digits": SUMMARY_DIGITS,
    }


def differing(a: list[dict], b: list[dict]) -> dict:
    """How many samples two manifests' entries disagree on, part by part (shared ids only)."""
    mine = {e["sample_id"]: e for e in a}
    theirs = {e["sample_id"]: e for e in b}
    shared = sorted(mine.keys() & theirs.keys())
    out = {"shared": len(shared), "only_one": len(mine.keys() ^ theirs.keys())}
    for part in ("tokens", "states_summary"):
        out[part] = sum(
            (mine[i].get("content") or {}).get(part) != (theirs[i].get("content") or {}).get(part)
            for i in shared
        )
    out["states_exact"] = sum(mine[i].get("crc32") != theirs[i].get("crc32") for i in shared)
    return out
