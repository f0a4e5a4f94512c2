"""Where the trainer's samples come from, and in what order.

The order is a plan fixed by (seed, epoch) alone: ids in sorted windows of `shuffle_window`,
each window permuted, then cut into batches. The stream delivers in id order, so a window is
the most it has to buffer; the offline shards are read in the same plan. Online and offline
training therefore see identical batches, and a resumed run can rebuild the plan and skip the
batches it already trained on.

    online   the trainer is the consumer of issue 3's stream: producers run the target now
    offline  hidden-state shards the extract stage wrote (mode offline or hybrid)

Data-parallel, each rank asks for its own samples: online it is one consumer of the stream
(its own coordinator; rank 0 starts the producers for all of them), offline it reads them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dspark.config import Params
from dspark.errors import DataError
from dspark.infra.plan import consumer_host
from dspark.schema import Sample
from dspark.train.distributed import Ranks
from dspark.transport.control import Coordinator
from dspark.transport.files import read_entry, read_hidden_manifest
from dspark.transport.stores import FileStore, MooncakeStore, PayloadStore
from dspark.transport.stream import StreamConsumer


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
    ranks: Ranks | None = None,
) -> Iterator[Source]:
    """A Source over `ids` (any order of requests within the plan's windows). With `ranks`,
    every rank must open its source at the same point (the stream's setup is collective)."""
    if not online:
        yield Source(HiddenShards(hidden_dir).read(sorted(ids)))
        return
    if ranks is not None:
        with rank_stream(params, sorted(ids), ranks, target_dir, shards_dir) as consumer:
            yield Source(iter(consumer))
        return
    from dspark.extract.stage import open_stream

    with open_stream(
        params, target_dir=target_dir, shards_dir=shards_dir, sample_ids=sorted(ids)
    ) as stream:
        x = params.extract
        (consumer,) = stream.consumers(fetch_timeout=x.fetch_timeout, idle_timeout=x.idle_timeout)
        yield Source(iter(consumer))


@contextmanager
def rank_stream(
    params: Params, ids: list[int], ranks: Ranks, target_dir: Path, shards_dir: Path
) -> Iterator[StreamConsumer]:
    """This rank's consumer of one stream: every rank listens for its own ids; rank 0 starts
    the master and producers for all of them and tells the others where the payloads are."""
    from dspark.extract.stage import MOONCAKE_ENV, new_run_id, open_stream

    x = params.extract
    run_id = ranks.broadcast(new_run_id() if ranks.leader else None)
    if ranks.leader:
        addresses = ranks.gather(None)[1:]
        with open_stream(
            params,
            target_dir=target_dir,
            shards_dir=shards_dir,
            sample_ids=ids,
            peers=addresses,
            run_id=run_id,
        ) as stream:
            store = stream.store
            ranks.broadcast(stream.master.address if stream.master else str(store.folder))
            (consumer,) = stream.consumers(
                fetch_timeout=x.fetch_timeout, idle_timeout=x.idle_timeout
            )
            yield consumer
            ranks.barrier()  # every rank is done with the payloads before they go
        return
    coordinator = Coordinator(
        ids,
        host=consumer_host(params),  # the producers, maybe on other nodes, connect here
        port=x.control_port + ranks.rank if x.control_port else 0,
        max_in_flight=x.max_in_flight,
        heartbeat_timeout=x.heartbeat_timeout,
        run_id=run_id,
    )
    try:
        ranks.gather(coordinator.address)
        where = ranks.broadcast(None)
        if x.transport == "mooncake":
            for key, value in MOONCAKE_ENV.items():
                os.environ.setdefault(key, value)
            host = where.rsplit(":", 1)[0]  # the master binds on this machine's consumer side
            store: PayloadStore = MooncakeStore(
                where, host=host, segment_bytes=0, buffer_bytes=x.buffer_mb << 20
            )
        else:
            store = FileStore(Path(where))
        yield StreamConsumer(
            coordinator, store, fetch_timeout=x.fetch_timeout, idle_timeout=x.idle_timeout
        )
        coordinator.close()  # `done` to the producers: they exit once every rank has said it
        ranks.barrier()
        store.close()
    finally:
        coordinator.close()
