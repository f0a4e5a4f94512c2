"""A producer process of the inference plane: its own target, capturing and publishing samples.

    python -m dspark.extract.producer CONFIG.json

It connects to every consumer's coordinator (one per trainer rank), captures what each assigns,
stores the payload, announces the manifest to that consumer, heartbeats, and frees a payload
once its consumer acknowledges it. A sample without a response (a prompt the prepare stage's
`extract` generator left to us) is answered first, greedily, on our batched decoder, which keeps the
hidden states as it decodes (`onpolicy.py`): one pass over the target for both. A lost
coordinator (a restarted consumer) is reconnected to; the work it had assigned is discarded.
The bytes move through dspark.transport (the control protocol, the payload stores and the wire
manifest); capturing them is extraction's job.
"""

from __future__ import annotations

import functools
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

import torch

from dspark.procs import adopt_niceness

log = logging.getLogger("dspark.producer")


@dataclass(frozen=True)
class ProducerConfig:
    name: str
    coordinators: list[str]  # host:port of each consumer's coordinator (one per trainer rank)
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
    max_prompt_tokens: int = 512  # prompts to answer: the longest, and how many new tokens
    max_new_tokens: int = 128
    rows: int = 32  # prompts answered together

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


# This process's decode steps, which every session's heartbeat reports (a one-item list: the
# sessions' heartbeat threads read what the main loop writes; an int read is atomic).
DECODE_STEPS = [0]


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


class Session:
    """This producer's link to one consumer's coordinator; reconnects after a consumer restart.

    Work carries the session's generation: what a lost connection assigned is dropped, since
    the restarted consumer assigns again from its own checkpoint.
    """

    def __init__(self, cfg: ProducerConfig, address: str, sock: socket.socket, work, store):
        self.cfg, self.address, self.work, self.store = cfg, address, work, store
        self.sock, self.lock = sock, threading.Lock()
        self.generation = 0
        self.held: dict[int, str] = {}  # sample id -> handle of the payload we still hold
        self.finished = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def send(self, msg: dict) -> bool:
        from dspark.transport.control import send

        return send(self.sock, self.lock, msg)

    def _run(self) -> None:
        from dspark.transport.control import lines

        while True:
            self.send({"type": "hello", "producer": self.cfg.name, "run_id": self.cfg.run_id})
            for msg in lines(self.sock):
                if msg["type"] == "assign":
                    for sid in msg["sample_ids"]:
                        self.work.put((self, self.generation, sid))
                elif msg["type"] == "ack":
                    handle = self.held.pop(msg["sample_id"], None)
                    if handle is not None:
                        self.store.delete(handle)
                elif msg["type"] == "done":
                    if "why" in msg:
                        log.warning(
                            "%s: the coordinator at %s says done: %s",
                            self.cfg.name,
                            self.address,
                            msg["why"],
                        )
                    self._release()
                    self.finished.set()
                    self.work.put(None)
                    return
            # The consumer went away without `done`: free what it never took, wait for it.
            self.generation += 1
            self._release()
            self.sock.close()
            try:
                sock = connect(self.address, self.cfg.reconnect_for)
            except CoordinatorUnreachable:
                log.warning("consumer at %s did not come back; giving up on it", self.address)
                self.finished.set()
                self.work.put(None)
                return
            with self.lock:
                self.sock = sock

    def _release(self) -> None:
        for sid in list(self.held):
            self.store.delete(self.held.pop(sid))

    def _beat(self) -> None:
        while not self.finished.wait(self.cfg.heartbeat_s):
            # The decode steps so far: a consumer waiting minutes for a row's answer can tell
            # a producer at work from one that is stuck.
            self.send({"type": "heartbeat", "progress": DECODE_STEPS[0]})


def serve(cfg: ProducerConfig) -> int:
    """Produce until every consumer says done. Returns the number of samples published."""
    from dspark.data.shards import iter_samples
    from dspark.extract.capture import HiddenStateCapture
    from dspark.models.target import load_target

    torch.set_num_threads(cfg.threads)
    # Connect first: a wrong peer fails in seconds, before minutes of loading.
    socks = [connect(a, cfg.connect_timeout) for a in cfg.coordinators]
    samples = {s.sample_id: s for s in iter_samples(Path(cfg.shards_dir))}
    target = load_target(Path(cfg.target_dir))
    capture = HiddenStateCapture(target, cfg.aux_layers, cfg.wire_dtype, cfg.topk)
    store = make_store(cfg)
    work: queue.Queue = queue.Queue()
    sessions = [
        Session(cfg, a, s, work, store) for a, s in zip(cfg.coordinators, socks, strict=True)
    ]
    out = Publisher(cfg, store)
    answering = Answering(cfg, target, capture)
    while not all(s.finished.is_set() for s in sessions):
        # Idle, wait for work; while rows decode, take only what has arrived.
        for item in _arrived(work, block=not answering.busy):
            session, generation, sid = item
            if not out.current(session, generation):
                continue  # assigned by a consumer that has since restarted
            if samples[sid].loss_mask.any():
                out.publish(session, generation, sid, lambda s=samples[sid]: capture(s))
            else:
                answering.waiting.append(item)
        for (session, generation, sid), make in answering.advance(samples, out):
            out.publish(session, generation, sid, make)
    capture.close()
    store.close()
    return out.published


def _arrived(work: queue.Queue, block: bool) -> list:
    items = []
    try:
        items.append(work.get(block=block))
        while True:
            items.append(work.get_nowait())
    except queue.Empty:
        pass
    return [i for i in items if i is not None]  # None: a session ended, look again


class Publisher:
    """Stores a sample's payload and announces it to the consumer that asked for it."""

    def __init__(self, cfg: ProducerConfig, store):
        self.cfg, self.store = cfg, store
        self.corrupt, self.published, self.attempts = cfg.corrupt_sample, 0, 0

    @staticmethod
    def current(session: Session, generation: int) -> bool:
        return generation == session.generation and not session.finished.is_set()

    def publish(self, session: Session, generation: int, sid: int, make) -> None:
        """`make()` -> the Sample; what it raises (non-finite or schema errors, a prompt that
        does not fit) goes to the consumer, which must know."""
        from dspark.transport.wire import handle_for, make_manifest

        if not self.current(session, generation):
            return
        if self.cfg.throttle_s:
            time.sleep(self.cfg.throttle_s)
        try:
            sample = make()
        except Exception as e:
            session.send({"type": "failed", "sample_id": sid, "error": str(e)})
            return
        # A fresh key per attempt: Mooncake keeps the old value when a key is put again.
        self.attempts += 1
        handle = handle_for(self.cfg.run_id, sid, f"{self.cfg.name}.{self.attempts}")
        manifest = make_manifest(sample, handle)
        tensors = sample.tensors()
        if sid == self.corrupt:
            self.corrupt = -1
            tensors = {**tensors, "aux_hidden": tensors["aux_hidden"].clone()}
            tensors["aux_hidden"].view(-1).view(torch.uint8)[0] ^= 0xFF
        self.store.put(manifest, tensors)
        session.held[sid] = handle
        self.published += 1
        session.send({"type": "ready", "manifest": manifest})


class Answering:
    """Prompts waiting for a row, and the decoder answering them (made on the first prompt:
    its cache is the size of `rows` full rows)."""

    def __init__(self, cfg: ProducerConfig, target, capture):
        self.cfg, self.target, self.capture = cfg, target, capture
        self.waiting: list = []
        self.decoder = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or (self.decoder is not None and self.decoder.busy)

    def _decoder(self):
        if self.decoder is None:
            from dspark.decode.llama import Llama
            from dspark.extract.onpolicy import OnPolicyDecoder

            t = self.target
            taps = tuple(sorted({*self.cfg.aux_layers, t.num_layers - 1}))
            self.decoder = OnPolicyDecoder(
                Llama.from_hf(t.model),
                t.eos_token_id,
                t.max_context,
                taps,
                self.cfg.rows,
                self.cfg.max_prompt_tokens,
                self.cfg.max_new_tokens,
                topk=self.cfg.topk,
            )
        return self.decoder

    def advance(self, samples: dict, out: Publisher) -> list:
        """Admit waiting prompts into free rows, decode one step -> [(item, make)] for the
        samples whose answers ended (a prompt that cannot be admitted fails at once)."""
        if not self.busy:
            return []
        ready = []
        try:
            dec = self._decoder()
        except ValueError as e:  # rows that cannot hold a prompt and its answer: every one fails
            for session, generation, sid in self.waiting:
                ready.append(((session, generation, sid), functools.partial(_raise, str(e))))
            self.waiting.clear()
            return ready
        while self.waiting and dec.free:
            item = self.waiting.pop(0)
            session, generation, sid = item
            if not out.current(session, generation):
                continue
            try:
                dec.admit(item, samples[sid].input_ids.tolist())
            except ValueError as e:
                ready.append((item, functools.partial(_raise, f"sample {sid}: {e}")))
        dec.drop(lambda key: out.current(key[0], key[1]))  # a consumer that restarted or ended
        if dec.busy:
            DECODE_STEPS[0] += 1
            for a in dec.step():
                ready.append((a.key, functools.partial(self._package, a)))
        return ready

    def _package(self, answered):
        ids = torch.tensor(answered.input_ids, dtype=torch.int32)
        mask = torch.arange(len(ids)) >= answered.prompt_len
        return self.capture.package(
            answered.key[2], ids, mask, answered.feats, answered.target_topk
        )


def _raise(message: str):
    raise ValueError(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("DSPARK_LOG", "WARNING"), format="%(asctime)s %(name)s: %(message)s"
    )
    adopt_niceness()  # a session of its own: keep the stage's niceness (a nice-19 full run)
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
