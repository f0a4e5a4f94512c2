"""The coordinator's bookkeeping, driven by a hand-rolled producer over a real loopback socket."""

import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dspark.transport.control import PEER_THREAD, Coordinator


class FakeProducer:
    def __init__(self, address, name="fake", run_id="", hello=True):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.buf = b""
        self.hello = {"type": "hello", "producer": name, "run_id": run_id}
        if hello:
            self.send(self.hello)

    def send(self, msg):
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def messages(self, wait=0.5):
        self.sock.settimeout(wait)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buf += chunk
        except TimeoutError:
            pass
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line]


def manifest(sid):
    return {"metadata": {"sample_id": sid}}


def test_credits_bound_what_is_in_flight():
    coordinator = Coordinator(list(range(20)), max_in_flight=3)
    try:
        producer = FakeProducer(coordinator.address)
        assigned = [
            s for m in producer.messages() if m["type"] == "assign" for s in m["sample_ids"]
        ]
        assert assigned == [0, 1, 2]  # lowest ids first, and no more than the credits
        producer.send({"type": "ready", "manifest": manifest(0)})
        time.sleep(0.2)
        assert producer.messages(0.3) == []  # ready but not consumed: still in flight
        (got,) = coordinator.take_ready(timeout=2)
        coordinator.fetched(0, got[1])
        coordinator.delivered(0)
        msgs = producer.messages()
        assert {"type": "ack", "sample_id": 0} in msgs
        assert [s for m in msgs if m["type"] == "assign" for s in m["sample_ids"]] == [3]
    finally:
        coordinator.close()


def test_duplicates_are_dropped_and_released():
    coordinator = Coordinator([0, 1], max_in_flight=2)
    try:
        a = FakeProducer(coordinator.address, "a")
        a.messages()
        a.send({"type": "ready", "manifest": manifest(0)})
        a.send({"type": "ready", "manifest": manifest(0)})
        a.send({"type": "ready", "manifest": manifest(7)})  # never ours (a stale session's)
        wait_until(lambda: coordinator.stats.duplicates_dropped == 2, timeout=60)
        msgs = a.messages()
        assert {"type": "ack", "sample_id": 0} in msgs and {"type": "ack", "sample_id": 7} in msgs
    finally:
        coordinator.close()


def test_a_producer_failure_reaches_the_consumer():
    coordinator = Coordinator([0], max_in_flight=1)
    try:
        producer = FakeProducer(coordinator.address)
        producer.messages()
        producer.send(
            {
                "type": "failed",
                "sample_id": 0,
                "error": "sample 0: aux_hidden has non-finite values",
            }
        )
        with pytest.raises(RuntimeError, match="non-finite"):
            coordinator.take_ready(timeout=3)
    finally:
        coordinator.close()


def test_silent_producer_is_dropped_and_its_work_reassigned():
    coordinator = Coordinator([0, 1, 2], max_in_flight=2, heartbeat_timeout=0.6)
    try:
        quiet = FakeProducer(coordinator.address, "quiet")
        assert [s for m in quiet.messages() if m["type"] == "assign" for s in m["sample_ids"]] == [
            0,
            1,
        ]
        # No heartbeats: dropped after 0.6 s; waited for as long as a loaded machine needs.
        wait_until(lambda: coordinator.stats.producers_lost == 1, timeout=60)
        fresh = FakeProducer(coordinator.address, "fresh")
        assert [s for m in fresh.messages() if m["type"] == "assign" for s in m["sample_ids"]] == [
            0,
            1,
        ]
    finally:
        coordinator.close()


def test_a_producer_of_another_run_is_told_done_and_fed_nothing():
    """A killed trainer's producers keep reconnecting to a fixed control port: a rerun's
    coordinator there must not take samples from them (they may read other shards)."""
    coordinator = Coordinator([0, 1], max_in_flight=2, run_id="new")
    try:
        stale = FakeProducer(coordinator.address, "stale", run_id="old")
        assert stale.messages() == [{"type": "done", "why": "another run"}]
        assert coordinator.stats.stale_turned_away == 1
        fresh = FakeProducer(coordinator.address, "fresh", run_id="new")
        assigned = [s for m in fresh.messages() if m["type"] == "assign" for s in m["sample_ids"]]
        assert assigned == [0, 1]
    finally:
        coordinator.close()


def test_a_hello_after_close_is_told_done():
    """A producer's reconnect accepted just as the stream ends: close() tells the peers it has,
    so the late hello must hear `done` itself, or the producer waits out reconnect_for."""
    coordinator = Coordinator([0], max_in_flight=1)
    try:
        readers = {t for t in threading.enumerate() if t.name == PEER_THREAD}
        late = FakeProducer(coordinator.address, "late", hello=False)
        wait_until(
            lambda: any(t.name == PEER_THREAD and t not in readers for t in threading.enumerate())
        )
        coordinator.close()
        late.send(late.hello)
        assert late.messages() == [{"type": "done"}]
    finally:
        coordinator.close()


def test_nothing_is_assigned_after_close():
    coordinator = Coordinator([0, 1, 2], max_in_flight=1)
    try:
        producer = FakeProducer(coordinator.address)
        assert assigned(producer.messages()) == [0]
        producer.send({"type": "ready", "manifest": manifest(0)})
        [(_, name)] = coordinator.take_ready(timeout=5, limit=1)
        coordinator.close()
        coordinator.fetched(0, name)
        coordinator.delivered(0)  # frees a credit: before close() it would assign sample 1
        msgs = producer.messages()
        assert {"type": "done"} in msgs and assigned(msgs) == []
    finally:
        coordinator.close()


def assigned(msgs):
    return [s for m in msgs if m["type"] == "assign" for s in m["sample_ids"]]


def wait_until(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def serve_all(coordinator, producer, work, count, within=10.0):
    """Produce `work` and whatever else is assigned, consume it all, until `count` samples are
    delivered; the ids delivered."""
    delivered, deadline = [], time.monotonic() + within
    while len(delivered) < count:
        assert time.monotonic() < deadline, f"stalled after {delivered}"
        for sid in [*work, *assigned(producer.messages(0.1))]:
            producer.send({"type": "ready", "manifest": manifest(sid)})
        work = []
        for m, name in coordinator.take_ready(timeout=0.5, limit=count):
            sid = m["metadata"]["sample_id"]
            coordinator.fetched(sid, name)
            coordinator.delivered(sid)
            delivered.append(sid)
    return delivered


def test_a_late_close_of_a_replaced_connection_leaves_the_new_one_alone():
    """A producer reconnects under its name before the coordinator has seen its old
    connection close (the producer releases the old connection's work on reconnecting). When
    that close is processed last, the new connection keeps its entry and its ready samples,
    and keeps getting work until the stream is through."""
    coordinator = Coordinator(list(range(6)), max_in_flight=3, heartbeat_timeout=60)
    try:
        old = FakeProducer(coordinator.address, "p")
        assert assigned(old.messages()) == [0, 1, 2]
        new = FakeProducer(coordinator.address, "p")
        work = assigned(new.messages())
        assert work
        new.send({"type": "ready", "manifest": manifest(work[0])})
        new.send({"type": "ready", "manifest": manifest(99)})  # never ours: acked at once,
        assert {"type": "ack", "sample_id": 99} in new.messages()  # so the ready before is in
        old.sock.close()
        wait_until(lambda: coordinator.stats.producers_lost == 1)  # the old one, dropped once
        assert coordinator.live_producers() == 1
        (got,) = coordinator.take_ready(timeout=1)
        assert got == (manifest(work[0]), "p")

        coordinator.fetched(work[0], "p")
        coordinator.delivered(work[0])
        delivered = [work[0], *serve_all(coordinator, new, work[1:], 5)]
        assert sorted(delivered) == list(range(6))
        assert coordinator.stats.duplicates_dropped == 1  # sample 99 only
    finally:
        coordinator.close()


def test_a_replaced_connection_that_never_closes_holds_no_work():
    """The old connection stays open and silent (half-open, as after a network fault), with
    heartbeats far off: its assignments go to the new connection at once."""
    coordinator = Coordinator(list(range(6)), max_in_flight=3, heartbeat_timeout=60)
    try:
        old = FakeProducer(coordinator.address, "p")
        assert assigned(old.messages()) == [0, 1, 2]
        new = FakeProducer(coordinator.address, "p")
        assert sorted(serve_all(coordinator, new, [], 6)) == list(range(6))
        assert coordinator.live_producers() == 1 and coordinator.stats.producers_lost == 1
        old.sock.close()
    finally:
        coordinator.close()


def test_a_producer_that_keeps_decoding_keeps_the_stream_waiting():
    """Nothing ready for longer than the idle timeout, but heartbeats that report decode steps:
    the consumer waits. Once the steps stop, it fails within the timeout, naming the wait."""
    from dspark.transport.stores import FileStore, TransportError
    from dspark.transport.stream import StreamConsumer

    coordinator = Coordinator([0], max_in_flight=1, heartbeat_timeout=60)
    stop = threading.Event()
    try:
        slow = FakeProducer(coordinator.address, "slow")

        def beat():
            step = 0
            while not stop.wait(0.1):
                step += 1 if time.monotonic() < decoding_until else 0
                slow.send({"type": "heartbeat", "progress": step})

        decoding_until = time.monotonic() + 2.0
        threading.Thread(target=beat, daemon=True).start()
        consumer = StreamConsumer(
            coordinator, FileStore(Path(tempfile.mkdtemp())), idle_timeout=0.8
        )
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"nothing received for 0\.8 s, and no producer"):
            next(iter(consumer))
        waited = time.monotonic() - t0
        assert 2.0 < waited < 60  # past the timeout while it decoded; failed once it stopped
    finally:
        stop.set()
        coordinator.close()
