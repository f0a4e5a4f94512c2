"""Where the trainer's samples come from, and in what order.

The order is a plan fixed by (seed, epoch) alone: ids in sorted windows of `shuffle_window`,
each window permuted, then cut into batches. The stream delivers in id order, so a window is
the most it has to buffer; the offline shards are read in the same plan. Online and offline
training therefore see identical batches, and a resumed run can rebuild the plan and skip the
batches it already trained on.

    online   the trainer is the consumer of issue 3's stream: producers run the target now
    offline  hidden-state shards the extract stage wrote (mode offline or hybrid)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dspark.config import Params
from dspark.errors import DataError
from dspark.schema import Sample
from dspark.transport.files import read_entry, read_hidden_manifest


def split_eval(ids: list[int], count: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids). The held-out ones are the lowest ids: prepare numbers samples
    in the seeded order it drew prompts, so they are a random draw, and the stream delivers
    them first, so holding them costs no extra pass."""
    ids = sorted(ids)
    if count >= len(ids):
        raise DataError(
            f"train.eval_samples: {count} held out of {len(ids)} samples leaves none to train on"
        )
    return ids[count:], ids[:count]


def epoch_plan(
    ids: list[int], epoch: int, seed: int, batch_size: int, window: int
) -> list[list[int]]:
    """The epoch's batches of sample ids (the last may be short)."""
    ids = sorted(ids)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order: list[int] = []
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        order += [chunk[i] for i in torch.randperm(len(chunk), generator=gen).tolist()]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class Source:
    """Yields the planned batches as lists of samples; counts the time spent waiting."""

    def __init__(self, samples: Iterator[Sample]):
        self._samples = samples
        self._buffer: dict[int, Sample] = {}
        self.wait_s = 0.0

    def take(self, ids: list[int]) -> list[Sample]:
        t0 = time.perf_counter()
        try:
            while not all(i in self._buffer for i in ids):
                sample = next(self._samples)
                self._buffer[sample.sample_id] = sample
        except StopIteration:
            missing = [i for i in ids if i not in self._buffer]
            raise DataError(f"the data source ended without sample {missing[0]}") from None
        finally:
            self.wait_s += time.perf_counter() - t0
        return [self._buffer.pop(i) for i in ids]


class HiddenShards:
    """Random access to the extract stage's hidden-state shards, CRC-checked on read."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        doc = read_hidden_manifest(self.folder)
        if not doc["payload"]:
            raise DataError(
                f"{self.folder}: extracted online, so no hidden states are on disk; train "
                "online, or set extract.mode to offline or hybrid"
            )
        self.entries = {e["sample_id"]: e for e in doc["samples"]}
        self.manifest = doc

    @property
    def ids(self) -> list[int]:
        return sorted(self.entries)

    def read(self, ids: list[int]) -> Iterator[Sample]:
        for sid in ids:
            entry = self.entries.get(sid)
            if entry is None:
                raise DataError(f"{self.folder}: no sample {sid}")
            yield read_entry(self.folder, entry)


@contextmanager
def open_source(
    params: Params,
    ids: list[int],
    *,
    target_dir: Path,
    shards_dir: Path,
    hidden_dir: Path,
    online: bool,
) -> Iterator[Source]:
    """A Source over `ids` (any order of requests within the plan's windows)."""
    if not online:
        yield Source(HiddenShards(hidden_dir).read(sorted(ids)))
        return
    from dspark.extract.stage import open_stream

    with open_stream(
        params, target_dir=target_dir, shards_dir=shards_dir, sample_ids=sorted(ids)
    ) as stream:
        (consumer,) = stream.consumers(fetch_timeout=params.extract.fetch_timeout)
        yield Source(iter(consumer))
