"""The consuming end of the stream: an iterator of verified samples in sample-id order."""

from __future__ import annotations

import time
from collections.abc import Iterator

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
    ):
        self.coordinator = coordinator
        self.store = store
        self.fetch_timeout = fetch_timeout
        self.idle_timeout = idle_timeout
        self.consumed: list[int] = []
        self.wait_s = 0.0
        self.bytes_received = 0

    def __iter__(self) -> Iterator[Sample]:
        buffer: dict[int, Sample] = {}
        idle_since = time.monotonic()
        for sid in self.coordinator.order:
            t0 = time.perf_counter()
            while sid not in buffer:
                got = self.coordinator.take_ready(timeout=1.0)
                if got is None:
                    if time.monotonic() - idle_since > self.idle_timeout:
                        raise TransportError(
                            f"stream: nothing received for {self.idle_timeout:.0f} s "
                            f"({self.coordinator.live_producers()} producers connected)"
                        )
                    continue
                idle_since = time.monotonic()
                manifest, producer = got
                got_id = int(manifest["metadata"]["sample_id"])
                try:
                    sample = verify(manifest, self.store.get(manifest, self.fetch_timeout))
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
