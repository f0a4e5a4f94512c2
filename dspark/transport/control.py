"""The control channel: what Mooncake lacks, on a small JSON-lines TCP protocol of our own.

The consumer (one per trainer rank) runs the coordinator; producers connect to it.

    producer -> coordinator   hello {producer, run_id}  ready {manifest}      heartbeat {progress}
                              failed {sample_id, error}
    coordinator -> producer   assign {sample_ids}       ack {sample_id}       done {why?}

Guarantees, all enforced here:
    credits        at most `max_in_flight` samples are assigned, stored or buffered at once,
                   so a slow trainer back-pressures the producers and memory stays bounded
    exactly once   by sample id: a sample is delivered once; a duplicate is dropped (and its
                   payload released); a sample whose fetch or CRC fails is assigned again
    order          samples are delivered in sample-id order through a reorder buffer bounded
                   by the credits, whatever the producers' timing
    liveness       a producer whose connection drops, or whose heartbeats stop for
                   `heartbeat_timeout` (SIGSTOP), is dropped and its samples re-assigned
    resume         `consumed` (from the trainer's checkpoint) is skipped entirely
    one run        a producer of another run (a killed trainer's, still reconnecting to a fixed
                   `extract.control_port`) is told `done` and never fed a sample: it may read
                   other shards or layers
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PEER_THREAD = "coordinator-peer"  # one per producer connection, reading its messages


def send(sock: socket.socket, lock: threading.Lock, msg: dict[str, Any]) -> bool:
    data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
    try:
        with lock:
            sock.sendall(data)
        return True
    except OSError:
        return False


def lines(sock: socket.socket):
    """Messages from a socket until it closes."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


def warn_if_exposed(host: str, what: str) -> None:
    if host not in LOOPBACK and not host.startswith("127."):
        log.warning(
            "%s binds %s: the control channel and Mooncake have no authentication; "
            "expose them only on a private, trusted network",
            what,
            host,
        )


@dataclass
class _Peer:
    name: str
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)
    outstanding: set[int] = field(default_factory=set)  # assigned, not yet fetched
    alive: bool = True
    progress: int = 0  # the decode steps its heartbeats last reported
    progressed_at: float = field(default_factory=time.monotonic)


@dataclass
class StreamStats:
    delivered: int = 0
    duplicates_dropped: int = 0
    reassigned: int = 0
    resent_after_error: int = 0
    producers_lost: int = 0
    stale_turned_away: int = 0  # producers of another run
    lost_at: list[float] = field(default_factory=list)  # time.monotonic() of each loss


class Coordinator:
    """The consumer side's bookkeeping and listener. Thread-safe; `next_ready()` is the only
    call the consuming thread makes."""

    def __init__(
        self,
        sample_ids: list[int],
        *,
        consumed: set[int] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_in_flight: int = 8,
        heartbeat_timeout: float = 3.0,
        run_id: str = "",
        per_producer: int | None = None,
    ):
        """`run_id`: the stream's; producers of any other are turned away ("": take any).
        `per_producer`: the most samples one producer works on at once (None: any share of the
        credits), so the first producer to say hello cannot take a batch meant for all."""
        warn_if_exposed(host, "the stream coordinator")
        self.run_id = run_id
        self.order = sorted(set(sample_ids) - (consumed or set()))
        self.pending: deque[int] = deque(self.order)
        self._wanted = frozenset(self.order)  # a ready for anything else is released unused
        self.max_in_flight = max_in_flight
        self.per_producer = per_producer
        self.heartbeat_timeout = heartbeat_timeout
        self.stats = StreamStats()
        self._cv = threading.Condition()
        self._peers: dict[str, _Peer] = {}
        self._ready: dict[int, tuple[dict, _Peer]] = {}  # sample id -> (manifest, connection)
        self._fetching: set[int] = set()
        self._buffered: set[int] = set()  # fetched, waiting for their turn
        self._done: set[int] = set()
        self._error: str | None = None
        self._closed = False
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.5)
        host_, port_ = self._listener.getsockname()[:2]
        self.address = f"{host_}:{port_}"
        self._threads = [
            threading.Thread(target=self._accept, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- producers ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(sock,), name=PEER_THREAD, daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        peer: _Peer | None = None
        for msg in lines(sock):
            kind = msg.get("type")
            with self._cv:
                if kind == "hello" and self._closed:
                    # Reconnected after the stream ended (close() told only the peers it had):
                    # without `done` it would wait out reconnect_for on a closed port.
                    send(sock, threading.Lock(), {"type": "done"})
                    break
                if kind == "hello" and self.run_id and msg.get("run_id") != self.run_id:
                    self.stats.stale_turned_away += 1
                    log.warning(
                        "turned away %s of run %s (this stream is run %s)",
                        msg.get("producer"),
                        msg.get("run_id"),
                        self.run_id,
                    )
                    send(sock, threading.Lock(), {"type": "done", "why": "another run"})
                    break
                if kind == "hello":
                    peer = _Peer(msg["producer"], sock)
                    old = self._peers.get(peer.name)
                    if old is not None and old.alive:
                        # Reconnected before its old connection's close reached us: the
                        # producer dropped that connection's work, and its close, read later,
                        # must not touch this one (so `_drop` goes by connection, not name).
                        self._drop(old, "replaced by a new connection")
                        with contextlib.suppress(OSError):
                            old.sock.shutdown(socket.SHUT_RDWR)
                    self._peers[peer.name] = peer
                    self._schedule()
                if peer is None or not peer.alive:
                    break
                peer.last_seen = time.monotonic()
                if kind == "heartbeat" and msg.get("progress", peer.progress) != peer.progress:
                    peer.progress, peer.progressed_at = msg["progress"], peer.last_seen
                if kind == "ready":
                    peer.progressed_at = peer.last_seen
                    self._on_ready(peer, msg["manifest"])
                elif kind == "failed":
                    self._error = f"producer {peer.name}: sample {msg['sample_id']}: {msg['error']}"
                self._cv.notify_all()
        with self._cv:
            if peer is not None and peer.alive and not self._closed:
                self._drop(peer, "connection closed")
        sock.close()

    def _on_ready(self, peer: _Peer, manifest: dict) -> None:
        sid = int(manifest["metadata"]["sample_id"])
        peer.outstanding.discard(sid)
        if (
            sid not in self._wanted
            or sid in self._done
            or sid in self._buffered
            or sid in self._ready
            or sid in self._fetching
        ):
            self.stats.duplicates_dropped += 1
            send(peer.sock, peer.lock, {"type": "ack", "sample_id": sid})  # release it
            return
        self._ready[sid] = (manifest, peer)
        # Its producer has room again: refill it now, not when the sample's turn comes (a
        # producer answering prompts would idle its freed rows until the oldest one ends).
        self._schedule()

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(min(0.5, self.heartbeat_timeout / 4))
            now = time.monotonic()
            with self._cv:
                if self._closed:
                    return
                for peer in list(self._peers.values()):
                    if peer.alive and now - peer.last_seen > self.heartbeat_timeout:
                        self._drop(peer, f"no heartbeat for {self.heartbeat_timeout:.0f} s")
                        with contextlib.suppress(OSError):
                            peer.sock.shutdown(socket.SHUT_RDWR)

    def _drop(self, peer: _Peer, why: str) -> None:
        """Re-assign everything a lost producer held: its assignments and unfetched payloads."""
        peer.alive = False
        self.stats.producers_lost += 1
        self.stats.lost_at.append(time.monotonic())
        lost = set(peer.outstanding) | {s for s, (_, p) in self._ready.items() if p is peer}
        for sid in lost:
            self._ready.pop(sid, None)
        self._requeue(lost)
        log.warning("producer %s lost (%s); %d samples re-assigned", peer.name, why, len(lost))
        if self._peers.get(peer.name) is peer:  # not a newer connection under its name
            del self._peers[peer.name]
        self._schedule()
        self._cv.notify_all()

    def _requeue(self, ids: set[int]) -> None:
        for sid in sorted(ids, reverse=True):
            if sid not in self._done and sid not in self.pending:
                self.pending.appendleft(sid)
                self.stats.reassigned += 1

    def _in_flight(self) -> int:
        assigned = sum(len(p.outstanding) for p in self._peers.values())
        return assigned + len(self._ready) + len(self._fetching) + len(self._buffered)

    def _schedule(self) -> None:
        """Hand out credits: the lowest pending ids to the least-loaded live producers."""
        if self._closed:  # a `ready` or `delivered` after close() must not assign past `done`
            return
        live = [p for p in self._peers.values() if p.alive]
        while live and self.pending and self._in_flight() < self.max_in_flight:
            peer = min(live, key=lambda p: len(p.outstanding))
            if self.per_producer is not None and len(peer.outstanding) >= self.per_producer:
                break
            sid = self.pending.popleft()
            peer.outstanding.add(sid)
            if not send(peer.sock, peer.lock, {"type": "assign", "sample_ids": [sid]}):
                peer.outstanding.discard(sid)
                self.pending.appendleft(sid)
                break

    # -- the consuming thread -----------------------------------------------------------------

    def take_ready(self, timeout: float, limit: int = 1) -> list[tuple[dict, str]]:
        """Up to `limit` stored samples to fetch, lowest ids first; [] on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._ready:
                if self._error:
                    raise RuntimeError(self._error)
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            taken = []
            for sid in sorted(self._ready)[:limit]:
                manifest, peer = self._ready.pop(sid)
                taken.append((manifest, peer.name))
                self._fetching.add(sid)
            return taken

    def fetched(self, sid: int, producer: str) -> None:
        """The payload is safely in our hands: the producer may free it."""
        with self._cv:
            self._fetching.discard(sid)
            self._buffered.add(sid)
            peer = self._peers.get(producer)
            if peer is not None:
                send(peer.sock, peer.lock, {"type": "ack", "sample_id": sid})

    def fetch_failed(self, sid: int, producer: str, why: str) -> None:
        """Fetch or verification failed: have the sample produced again."""
        with self._cv:
            self._fetching.discard(sid)
            self.stats.resent_after_error += 1
            peer = self._peers.get(producer)
            if peer is not None:
                send(peer.sock, peer.lock, {"type": "ack", "sample_id": sid})
            log.warning("sample %d from %s failed (%s); producing it again", sid, producer, why)
            self._requeue({sid})
            self._schedule()

    def delivered(self, sid: int) -> None:
        with self._cv:
            self._buffered.discard(sid)
            self._done.add(sid)
            self.stats.delivered += 1
            self._schedule()

    def last_progress(self) -> float | None:
        """When a connected producer last got on with its work (a decode step in a heartbeat,
        or a sample ready), on time.monotonic's clock; None with no producer connected."""
        with self._cv:
            times = [p.progressed_at for p in self._peers.values() if p.alive]
        return max(times) if times else None

    def live_producers(self) -> int:
        with self._cv:
            return sum(p.alive for p in self._peers.values())

    def close(self) -> None:
        """Tell every producer `done`: those connected now here, a hello read later in `_serve`.
        A connection still in the listen backlog is reset with the listener, and its producer
        waits out `reconnect_for` before it gives up."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for peer in self._peers.values():
                send(peer.sock, peer.lock, {"type": "done"})
        self._listener.close()
