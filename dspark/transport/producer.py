"""A producer process of the inference plane: its own target, capturing and publishing samples.

    python -m dspark.transport.producer CONFIG.json

It connects to each consumer's coordinator, captures what it is assigned, stores the payload,
announces the manifest, heartbeats, and frees a payload once the consumer acknowledges it. A
lost coordinator (a restarted consumer) is reconnected to; its earlier work is discarded.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("dspark.producer")


@dataclass(frozen=True)
class ProducerConfig:
    name: str
    coordinator: str  # host:port
    run_id: str
    target_dir: str
    shards_dir: str
    aux_layers: list[int]
    wire_dtype: str
    topk: int
    store: str  # "mooncake" | "files"
    master: str = ""  # mooncake_master host:port
    files_dir: str = ""
    host: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 64 << 20
    threads: int = 1
    heartbeat_s: float = 0.5
    connect_timeout: float = 10.0
    reconnect_for: float = 60.0  # how long to wait for a restarted consumer
    throttle_s: float = 0.0  # tests: a slower producer, to fault it mid-stream
    corrupt_sample: int = -1  # tests: flip one payload byte of this sample, once

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


class CoordinatorUnreachable(RuntimeError):
    pass


def connect(address: str, timeout: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, int(port)), timeout=min(2.0, timeout))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise CoordinatorUnreachable(
        f"cannot reach the stream coordinator at {address} within {timeout:.0f} s ({last})"
    )


def make_store(cfg: ProducerConfig):
    from dspark.transport.stores import FileStore, MooncakeStore

    if cfg.store == "mooncake":
        return MooncakeStore(
            cfg.master,
            host=cfg.host,
            segment_bytes=cfg.segment_bytes,
            buffer_bytes=cfg.buffer_bytes,
        )
    return FileStore(Path(cfg.files_dir))


def serve(cfg: ProducerConfig) -> int:
    """Produce until the coordinator says done. Returns the number of samples published."""
    import torch

    from dspark.data.shards import iter_samples
    from dspark.extract.capture import HiddenStateCapture
    from dspark.models.target import load_target
    from dspark.transport.control import lines, send
    from dspark.transport.wire import handle_for, make_manifest

    torch.set_num_threads(cfg.threads)
    sock = connect(cfg.coordinator, cfg.connect_timeout)  # fail fast on a wrong peer
    samples = {s.sample_id: s for s in iter_samples(Path(cfg.shards_dir))}
    target = load_target(Path(cfg.target_dir))
    capture = HiddenStateCapture(target, cfg.aux_layers, cfg.wire_dtype, cfg.topk)
    store = make_store(cfg)
    corrupt = cfg.corrupt_sample
    published = 0

    while True:  # one coordinator session per pass; a restarted consumer means a new one
        lock = threading.Lock()
        work: queue.Queue[int | None] = queue.Queue()
        held: set[str] = set()
        said_done, stop = threading.Event(), threading.Event()
        send(sock, lock, {"type": "hello", "producer": cfg.name})

        def read(sock=sock, work=work, held=held, said_done=said_done):
            for msg in lines(sock):
                if msg["type"] == "assign":
                    for sid in msg["sample_ids"]:
                        work.put(sid)
                elif msg["type"] == "ack":
                    handle = handle_for(cfg.run_id, msg["sample_id"])
                    if handle in held:
                        held.discard(handle)
                        store.delete(handle)
                elif msg["type"] == "done":
                    said_done.set()
                    break
            work.put(None)

        def beat(sock=sock, lock=lock, stop=stop):
            while not stop.is_set() and send(sock, lock, {"type": "heartbeat"}):
                stop.wait(cfg.heartbeat_s)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=beat, daemon=True).start()
        while (sid := work.get()) is not None:
            if cfg.throttle_s:
                time.sleep(cfg.throttle_s)
            try:
                sample = capture(samples[sid])
            except Exception as e:  # non-finite or schema errors: the consumer must know
                send(sock, lock, {"type": "failed", "sample_id": sid, "error": str(e)})
                continue
            handle = handle_for(cfg.run_id, sid)
            manifest = make_manifest(sample, handle)
            tensors = sample.tensors()
            if sid == corrupt:
                corrupt = -1
                tensors = {**tensors, "aux_hidden": tensors["aux_hidden"].clone()}
                tensors["aux_hidden"].view(-1).view(torch.uint8)[0] ^= 0xFF
            store.put(manifest, tensors)
            held.add(handle)
            published += 1
            send(sock, lock, {"type": "ready", "manifest": manifest})
        stop.set()
        for handle in list(held):  # whatever the consumer never took
            store.delete(handle)
        sock.close()
        if said_done.is_set():
            break
        try:
            sock = connect(cfg.coordinator, cfg.reconnect_for)
        except CoordinatorUnreachable:
            break
    capture.close()
    store.close()
    return published


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("DSPARK_LOG", "WARNING"), format="%(asctime)s %(name)s: %(message)s"
    )
    cfg = ProducerConfig(**json.loads(Path(argv[0]).read_text()))
    try:
        n = serve(cfg)
    except CoordinatorUnreachable as e:
        print(f"dspark producer {cfg.name}: error: {e}", file=sys.stderr)
        return 2
    log.info("producer %s published %d samples", cfg.name, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
