"""Hidden-state shards as a checkpoint: a stopped writer's finished shards are kept and the next
writer on the folder goes on after them, only if the fingerprint is the same."""

import json
import logging
import re

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


def test_another_fingerprint_starts_over_and_a_missing_shard_is_extracted_again(tmp_path):
    stopped_after(tmp_path, 6)
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-b")
    assert w.resumed == set() and not list(tmp_path.glob("hidden-*"))
    assert not (tmp_path / RESUME).exists()

    stopped_after(tmp_path, 6)
    (tmp_path / "hidden-00001.safetensors").unlink()  # gone: only its samples start over
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-a")
    assert w.resumed == {0, 1, 2}
    assert [p.name for p in tmp_path.glob("hidden-*")] == ["hidden-00000.safetensors"]


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


def test_damaged_shards_are_dropped_and_their_samples_extracted_again(tmp_path, caplog):
    """One shard cut short, a byte flipped in another: the resuming writer checks every adopted
    shard against the size and sha256 written beside it, drops the two with their samples
    (said on one line), keeps the third, and numbers new shards past the kept ones. Extracting
    the dropped samples again ends with every sample once, and every byte read verifies."""
    stopped_after(tmp_path, 9)  # shards 0-2, 3-5, 6-8
    files = json.loads((tmp_path / RESUME).read_text())["shard_files"]
    assert sorted(files) == [f"hidden-0000{i}.safetensors" for i in range(3)]
    cut = tmp_path / "hidden-00000.safetensors"
    cut.write_bytes(cut.read_bytes()[:-40])
    flipped = tmp_path / "hidden-00002.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0x40  # inside a tensor: the file still opens, its contents are wrong
    flipped.write_bytes(bytes(data))

    caplog.set_level(logging.WARNING, logger="dspark.extract")
    w = HiddenShardWriter(tmp_path, shard_size=3, keep_payload=True, fingerprint="fp-a")
    assert w.resumed == {3, 4, 5}
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.search(r"hidden-00000\.safetensors: (\d+) bytes, (?!\1)\d+ written;", line)
    assert "hidden-00002.safetensors: checksum differs" in line
    assert line.endswith("their 6 samples are extracted again")
    assert sorted(p.name for p in tmp_path.glob("hidden-*")) == ["hidden-00001.safetensors"]
    for sid in (0, 1, 2, 6, 7, 8):
        w.add(sample(sid))
    doc = w.close({})
    assert sorted(e["sample_id"] for e in doc["samples"]) == list(range(9))  # each once
    assert {e["shard"] for e in doc["samples"]} == {
        f"hidden-0000{i}.safetensors" for i in (1, 2, 3)
    }
    got = list(iter_hidden(tmp_path))  # CRC-verified
    assert [s.sample_id for s in got] == list(range(9))
    for s in got:
        assert torch.equal(s.aux_hidden, sample(s.sample_id).aux_hidden)
