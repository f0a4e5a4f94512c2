import pytest
import torch

from dspark.data import shards
from dspark.errors import DataError


def samples(start, n):
    out = []
    for i in range(n):
        ids = torch.arange(3 + i, dtype=torch.int32)
        mask = torch.zeros(3 + i, dtype=torch.bool)
        mask[2:] = True
        out.append(shards.TokenSample(start + i, f"p{start + i}", ids, mask))
    return out


def test_roundtrip_and_manifest(tmp_path):
    entries = [
        shards.write_shard(
            tmp_path / shards.shard_name(i), samples(i * 3, 3), regenerated=1, fingerprint="f"
        )
        for i in range(2)
    ]
    shards.write_manifest(tmp_path, entries, {"target": "t"})
    back = list(shards.iter_samples(tmp_path))
    assert [s.sample_id for s in back] == list(range(6))
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(back, samples(0, 3) + samples(3, 3), strict=True)
    )
    doc = shards.read_manifest(tmp_path)
    assert doc["num_samples"] == 6 and doc["regenerated"] == 2
    assert doc["response_tokens"] == sum(int(s.loss_mask.sum()) for s in back)


def test_corruption_is_caught(tmp_path):
    entry = shards.write_shard(
        tmp_path / shards.shard_name(0), samples(0, 2), regenerated=0, fingerprint="f"
    )
    shards.write_manifest(tmp_path, [entry], {})
    path = tmp_path / entry["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum differs"):
        list(shards.iter_samples(tmp_path))
    path.write_bytes(b"not a shard")
    with pytest.raises(DataError, match="not a readable shard"):
        shards.read_shard(path)


def test_missing_manifest_means_unfinished(tmp_path):
    with pytest.raises(DataError, match=r"manifest\.json: missing"):
        shards.read_manifest(tmp_path)
