"""The consuming end of the stream: an iterator of verified samples in sample-id order."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from dspark.schema import Sample, SampleError
from dspark.transport.control import Coordinator
from dspark.transport.stores import PayloadStore, TransportError
from dspark.transport.wire import verify


class StreamConsumer:
    """Iterate to receive; `consumed` (sample ids) is what a trainer checkpoint stores.

    Waiting time is measured so the trainer can report its stall fraction: the share of its
    wall time spent waiting for data.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        store: PayloadStore,
        *,
        fetch_timeout: float = 10.0,
        idle_timeout: float = 120.0,
        fetch_batch: int = 8,
    ):
        self.coordinator = coordinator
        self.store = store
        self.fetch_timeout = fetch_timeout
        self.idle_timeout = idle_timeout
        self.fetch_batch = fetch_batch
        self.consumed: list[int] = []
        self.wait_s = 0.0
        self.bytes_received = 0

    def __iter__(self) -> Iterator[Sample]:
        buffer: dict[int, Sample] = {}
        idle_since = time.monotonic()
        for sid in self.coordinator.order:
            t0 = time.perf_counter()
            while sid not in buffer:
                taken = self.coordinator.take_ready(timeout=1.0, limit=self.fetch_batch)
                if not taken:
                    # A producer that is decoding (its heartbeats say so) is slow, not stuck: a
                    # starved one answered no row for 10 minutes in a study's extraction.
                    busy = self.coordinator.last_progress() or idle_since
                    if time.monotonic() - max(idle_since, busy) > self.idle_timeout:
                        raise TransportError(
                            f"stream: nothing received for {self.idle_timeout:g} s, and no "
                            f"producer decoding ({self.coordinator.live_producers()} "
                            "producers connected)"
                        )
                    continue
                idle_since = time.monotonic()
                # One batched fetch: per-object overhead dominates small (~1 MB) samples.
                payloads = self.store.get_many([m for m, _ in taken], self.fetch_timeout)
                for (manifest, producer), payload in zip(taken, payloads, strict=True):
                    got_id = int(manifest["metadata"]["sample_id"])
                    try:
                        if isinstance(payload, Exception):
                            raise payload
                        sample = verify(manifest, payload)
                    except (TransportError, SampleError) as e:
                        self.coordinator.fetch_failed(got_id, producer, str(e))
                        continue
                    self.bytes_received += manifest["metadata"]["total_aligned_bytes"]
                    self.coordinator.fetched(got_id, producer)
                    buffer[got_id] = sample
            self.wait_s += time.perf_counter() - t0
            sample = buffer.pop(sid)
            self.coordinator.delivered(sid)
            self.consumed.append(sid)
            yield sample


def batches(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    """Group a stream into training batches of `size` samples, in stream order (the last may
    be short). Padding and collation are the trainer's: samples differ in length."""
    batch: list[Sample] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
