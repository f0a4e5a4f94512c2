"""Hidden-state shards as a checkpoint: a stopped writer's finished shards are kept and the next
writer on the folder goes on after them, only if the fingerprint is the same."""

import json

import torch

from dspark.schema import Sample
from dspark.transport.files import MANIFEST, RESUME, HiddenShardWriter, iter_hidden


def sample(sid: int, s: int = 4, h: int = 6) -> Sample:
    g = torch.Generator().manual_seed(sid)
    return Sample(
        sample_id=sid,
        input_ids=torch.arange(s, dtype=torch.int32) + sid,
        loss_mask=torch.tensor([False] + [True] * (s - 1)),
        aux_hidden=torch.randn(3, s, h, generator=g).to(torch.bfloat16),
        last_hidden=torch.randn(s, h, generator=g).to(torch.bfloat16),
    )


def stopped_after(folder, n: int, fp: str = "fp-a") -> HiddenShardWriter:
    """A writer that added samples 0..n-1 and was never closed (the stage was killed)."""
    w = HiddenShardWriter(folder, shard_size=3, keep_payload=True, fingerprint=fp)
    for sid in range(n):
        w.add(sample(sid))
    return w


def test_a_stopped_writer_resumes_after_its_last_finished_shard(tmp_path):
    stopped_after(tmp_path, 7)  # shards of 0-2 and 3-5 on disk; 6 was pending, so lost
    assert json.loads((tmp_path / RESUME).read_text())["shards"] == [
        "hidden-00000.safetensors",
        "hidden-00001.safetensors",
    ]
    (tmp_path / "hidden-00002.safetensors").write_bytes(b"after the last checkpoint")

    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-a")
    assert w.resumed == set(range(6))
    assert not (tmp_path / "hidden-00002.safetensors").exists()  # not listed: dropped
    for sid in range(6, 10):
        w.add(sample(sid))
    assert [a["samples"] for a in w.all_attempts()] == [6, 4]  # the first as of its last shard
    doc = w.close({})
    assert not (tmp_path / RESUME).exists() and "attempts" not in doc  # no timings: same hash
    got = list(iter_hidden(tmp_path))  # CRC-verified against the manifest
    assert [s.sample_id for s in got] == list(range(10))
    for s in got:
        assert torch.equal(s.aux_hidden, sample(s.sample_id).aux_hidden)
    assert sum(e["response_tokens"] for e in doc["samples"]) == 10 * 3


def test_another_fingerprint_or_a_missing_shard_starts_over(tmp_path):
    stopped_after(tmp_path, 6)
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-b")
    assert w.resumed == set() and not list(tmp_path.glob("hidden-*"))
    assert not (tmp_path / RESUME).exists()

    stopped_after(tmp_path, 6)
    (tmp_path / "hidden-00001.safetensors").unlink()
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-a")
    assert w.resumed == set() and not list(tmp_path.glob("hidden-*"))


def test_no_fingerprint_or_no_payload_never_resumes(tmp_path):
    stopped_after(tmp_path, 6)
    assert HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True).resumed == set()
    stopped_after(tmp_path, 6)
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=False, fingerprint="fp-a")
    assert w.resumed == set()
    w.add(sample(0))
    assert w.close({})["num_samples"] == 1 and (tmp_path / MANIFEST).exists()


def test_a_finished_folder_run_again_keeps_every_shard_and_the_same_manifest(tmp_path):
    w = stopped_after(tmp_path, 6)
    w.close({"mode": "offline"})
    first = (tmp_path / MANIFEST).read_bytes()
    again = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-a")
    assert again.resumed == set(range(6))
    assert (tmp_path / RESUME).exists()  # a stop before closing still keeps them
    again.close({"mode": "offline"})
    assert (tmp_path / MANIFEST).read_bytes() == first
    other = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-b")
    assert other.resumed == set() and not list(tmp_path.glob("hidden-*"))
