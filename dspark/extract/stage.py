"""The extract stage: producer processes capture hidden states and stream them to a consumer.

    inference plane   `extract.workers` producer processes, each with its own target
    transport         Mooncake (hs-connectors objects, payload in the producers' memory) or a
                      shared folder; manifests, credits and acks on our control channel
    training plane    this process: the consumer, verifying every sample in id order

Modes: `online` keeps nothing but a receipt (the trainer consumes the stream itself), `offline`
writes hidden-state shards, `hybrid` streams and caches.

With `prepare.engine: extract` the token shards hold prompts without answers, and the producers
answer them as they capture (greedy, continuously batched, `extract.decode_rows` rows each): the
on-policy data plane in one pass over the target. `onpolicy_tok_s` in the metrics is what it
delivers: prompt and response tokens with their hidden states, per wall-second of the stage.

A stopped offline or hybrid extraction resumes: the shards it finished stay (`resume.json`, see
dspark.transport.files) and a rerun streams only the samples they lack, if what the states
depend on is unchanged (`resume_fingerprint`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config import Params
from dspark.data.shards import read_manifest as read_token_manifest
from dspark.errors import ResourceError
from dspark.extract.capture import resolve_aux_layers
from dspark.extract.content import fingerprints, sample_content
from dspark.extract.producer import ProducerConfig
from dspark.infra import netns
from dspark.infra.plan import Producer, consumer_host, trainer_node
from dspark.infra.plan import producers as place_producers
from dspark.infra.spec import ClusterSpec
from dspark.infra.spec import resolve as resolve_spec
from dspark.metrics import EventLog
from dspark.procs import stop_processes
from dspark.progress import bar as progress_bar
from dspark.records import fingerprint
from dspark.schema import SCHEMA_VERSION, Sample
from dspark.stopping import exit_on_sigterm
from dspark.transport.control import Coordinator, StreamStats
from dspark.transport.files import HiddenShardWriter
from dspark.transport.master import MooncakeMaster
from dspark.transport.stores import FileStore, MooncakeStore, PayloadStore
from dspark.transport.stream import StreamConsumer

# Applied to the consumer and to every producer. The MC_TCP_* pair bounds a transfer from a
# frozen (SIGSTOPped) peer over an established connection to 5 s (30 s by default);
# MC_TRANSFER_TIMEOUT does the same for the raw transfer engine. One setup retry makes a
# missing master fail in ~4 s rather than ~90 s. Measured: /tmp study, see the issue 3 note.
MOONCAKE_ENV = {
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
    "MC_TCP_STATUS_TIMEOUT_SEC": "5",
    "MC_TRANSFER_TIMEOUT": "5",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "MC_LOG_LEVEL": "WARNING",
}


@dataclass
class StreamSetup:
    coordinators: list[Coordinator]  # one per consumer (trainer rank), ids split by rank
    store: PayloadStore
    producers: list[subprocess.Popen]
    run_id: str
    master: MooncakeMaster | None

    @property
    def coordinator(self) -> Coordinator:
        """The only coordinator of a single-consumer stream."""
        if len(self.coordinators) != 1:
            raise ValueError(f"{len(self.coordinators)} consumers: pick one of .coordinators")
        return self.coordinators[0]

    def consumers(self, **kwargs) -> list[StreamConsumer]:
        return [StreamConsumer(c, self.store, **kwargs) for c in self.coordinators]


def rank_ids(sample_ids: list[int], rank: int, world: int) -> list[int]:
    """The ids consumer `rank` of `world` receives: every world-th, so each rank stays ordered."""
    return [i for i in sample_ids if i % world == rank]


def _num_layers(target_dir: Path) -> int:
    import json

    return int(json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"])


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@contextmanager
def open_stream(
    params: Params,
    *,
    target_dir: Path,
    shards_dir: Path,
    sample_ids: list[int],
    consumed: set[int] | None = None,
    workdir: Path | None = None,
    producer_overrides: Callable[[int], dict] | None = None,
    peers: Sequence[str] = (),
    run_id: str | None = None,
) -> Iterator[StreamSetup]:
    """Start the transport (master, coordinator, producers); stop all of it on exit.

    `peers`: host:port of consumers' coordinators in other processes (the other trainer
    ranks, each listening for its own ids); the producers serve them too. This process is then
    one consumer, of all of `sample_ids`. `run_id` names the stream (default: a fresh one);
    the peers' coordinators must expect the same."""
    x = params.extract
    for key, value in MOONCAKE_ENV.items():
        os.environ.setdefault(key, value)
    aux = resolve_aux_layers(x.aux_layers, _num_layers(target_dir))
    spec = resolve_spec(params.provision.spec)
    _require_consumer_node(spec)
    host = consumer_host(params)  # the consumer side: coordinators and the master
    run_id = run_id or new_run_id()
    local = 1 if peers else x.consumers  # consumers in this process
    with ExitStack() as stack:
        scratch = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="dspark-stream-", dir=workdir))
        )
        credits, per_producer = params.stream_credits(len(sample_ids))
        coordinators = _open_coordinators(
            stack,
            params,
            sample_ids,
            consumed=consumed,
            host=host,
            local=local,
            max_in_flight=credits,
            per_producer=per_producer,
            run_id=run_id,
        )
        master, store = _open_store(stack, params, host, scratch)
        stream = dict(  # what every producer's config shares
            coordinators=[*(c.address for c in coordinators), *peers],
            run_id=run_id,
            target_dir=str(target_dir),
            shards_dir=str(shards_dir),
            aux_layers=aux,
            master=master.address if master else "",
            files_dir=str(scratch / "payloads"),
            rows=per_producer or x.decode_rows,  # no more rows than it will get samples
            threads=max(1, (os.cpu_count() or 1) // x.workers),
        )
        producers: list[subprocess.Popen] = []
        # Registered before the first start: a start that fails stops those already running.
        stack.callback(_stop_all, coordinators, producers)
        for slot in place_producers(spec, x.workers):
            cfg = _producer_config(params, slot, stream, producer_overrides)
            producers.append(_start_producer(slot, cfg, scratch))
        yield StreamSetup(coordinators, store, producers, run_id, master)


def _require_consumer_node(spec: ClusterSpec) -> None:
    """The consumer runs on the spec's training node: inside its network namespace, if any."""
    trainer = trainer_node(spec)
    if trainer.netns and netns.current() != trainer.netns:
        raise ResourceError(
            f"provision.spec: the consumer belongs on node {trainer.name} (namespace "
            f"{trainer.netns}); run the stage through `dspark`, which moves there"
        )


def _open_coordinators(
    stack: ExitStack,
    params: Params,
    sample_ids: list[int],
    *,
    consumed: set[int] | None,
    host: str,
    local: int,
    max_in_flight: int,
    per_producer: int | None,
    run_id: str,
) -> list[Coordinator]:
    """One coordinator per consumer in this process, each expecting its rank's ids; `stack`
    closes them."""
    x = params.extract
    coordinators = [
        Coordinator(
            rank_ids(sample_ids, rank, local),
            consumed=consumed,
            host=host,
            port=x.control_port + rank if x.control_port else 0,
            max_in_flight=max_in_flight,
            per_producer=per_producer,
            heartbeat_timeout=x.heartbeat_timeout,
            run_id=run_id,
        )
        for rank in range(local)
    ]
    for c in coordinators:
        stack.callback(c.close)
    return coordinators


def _open_store(
    stack: ExitStack, params: Params, host: str, scratch: Path
) -> tuple[MooncakeMaster | None, PayloadStore]:
    """The payload store `extract.transport` names, and its master if it has one (`stack` stops
    it)."""
    x = params.extract
    if x.transport == "mooncake":
        master = stack.enter_context(MooncakeMaster.start(host, log=scratch / "master.log"))
        store = MooncakeStore(
            master.address, host=host, segment_bytes=0, buffer_bytes=x.buffer_mb << 20
        )
        return master, store
    return None, FileStore(scratch / "payloads")


def _producer_config(
    params: Params,
    slot: Producer,
    stream: dict,
    overrides: Callable[[int], dict] | None,
) -> ProducerConfig:
    """Producer `slot`'s config: what the stream gives every producer, its own name and host,
    the rest from params. A test override of a key set here is a TypeError (two values)."""
    x, i = params.extract, slot.index
    return ProducerConfig(
        name=f"producer-{i}",
        wire_dtype=x.wire_dtype,
        topk=x.target_topk,
        store=x.transport,
        host=slot.address or x.host,
        segment_bytes=x.segment_mb << 20,
        buffer_bytes=16 << 20,
        max_prompt_tokens=params.prepare.max_prompt_tokens,
        max_new_tokens=params.prepare.max_new_tokens,
        **stream,
        **(overrides(i) if overrides else {}),
    )


def _start_producer(slot: Producer, cfg: ProducerConfig, scratch: Path) -> subprocess.Popen:
    """Producer `slot` as a child process, its config and log in `scratch`."""
    path = scratch / f"producer-{slot.index}.json"
    cfg.dump(path)
    with open(scratch / f"producer-{slot.index}.log", "w") as log:  # the child keeps its copy
        return subprocess.Popen(
            slot.command([sys.executable, "-m", "dspark.extract.producer", str(path)]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ},
            # Out of the caller's process group: a Ctrl-C or a cancelled flow run
            # signals the group, and the trainer still needs the stream to finish its
            # step and checkpoint. It stops them on exit; if it dies instead, they
            # give up on its coordinator after `reconnect_for`.
            start_new_session=True,
        )


def _stop_all(coordinators: list[Coordinator], procs: list[subprocess.Popen]) -> None:
    """Tell the producers the stream is done, give them a moment to exit, then make them."""
    for c in coordinators:
        c.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    stop_processes(procs, grace=15)


def resume_fingerprint(params: Params, target_dir: Path, shards_dir: Path) -> str:
    """What a sample's states depend on: the target, the token shards, the taps and the answering
    caps. Not the code, unlike the evaluation's records: a full run's extraction may span
    sessions, and a change elsewhere in the library must not throw hours of it away. The
    producer count, rows and transport only change how fast the same states arrive."""
    x, p = params.extract, params.prepare
    basis = {
        "target": params.target.model_dump(mode="json"),
        "aux_layers": resolve_aux_layers(x.aux_layers, _num_layers(target_dir)),
        "wire_dtype": x.wire_dtype,
        "target_topk": x.target_topk,
        "answering": [p.engine, p.max_prompt_tokens, p.max_new_tokens],
        # Answers and states no longer depend on the batch (dspark/decode/llama.py): shards of
        # an extraction from before do not mix with these.
        "decoding": "row-invariant",
        "schema_version": SCHEMA_VERSION,
    }
    files = [Path(shards_dir) / "manifest.json", Path(target_dir) / "config.json"]
    return fingerprint(basis, files, ())


@dataclass
class _Received:
    """What the consumers' threads hand over, under one lock: each sample goes to the shard
    writer, the counts, the progress bar, the event log and `on_sample`."""

    writer: HiddenShardWriter
    bar: Any  # dspark.progress.bar's
    log: EventLog
    t0: float
    on_sample: Callable[[Sample], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    sample_ids: list[int] = field(default_factory=list)
    tokens: int = 0  # this run's
    first_s: float | None = None  # start-up (the master, the targets loading), first answers
    errors: list[BaseException] = field(default_factory=list)

    def drain(self, consumer: StreamConsumer) -> None:
        try:
            for sample in consumer:
                with self.lock:
                    if self.first_s is None:
                        self.first_s = time.perf_counter() - self.t0
                    self.writer.add(sample, sample_content(sample))
                    self.tokens += sample.num_tokens
                    self.sample_ids.append(sample.sample_id)
                    if self.on_sample:
                        self.on_sample(sample)
                    self.bar.update(1)
                    n = len(self.sample_ids)
                    self.log.log(n, samples=n, tokens=self.tokens)
        except BaseException as e:  # re-raised on the calling thread
            self.errors.append(e)


def _drain_in_threads(consumers: list[StreamConsumer], received: _Received) -> None:
    """Each consumer drains its rank's share in a thread; the first error is raised here."""
    threads = [threading.Thread(target=received.drain, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if received.errors:
        raise received.errors[0]


def extract_stage(
    params: Params,
    *,
    target_dir: Path,
    shards_dir: Path,
    out_dir: Path,
    events: Path | None = None,
    progress: bool = True,
    on_sample: Callable[[Sample], None] | None = None,
    producer_overrides: Callable[[int], dict] | None = None,  # tests: fault a producer
) -> dict:
    """Run the stage; return its metrics. Each consumer drains its rank's share in a thread."""
    x = params.extract
    t0 = time.perf_counter()
    ids = list(range(read_token_manifest(shards_dir)["num_samples"]))
    writer = HiddenShardWriter(
        out_dir,
        shard_size=x.shard_size,
        keep_payload=x.mode in ("offline", "hybrid"),
        fingerprint=resume_fingerprint(params, target_dir, shards_dir),
    )
    resumed = writer.resumed & set(ids)
    log = EventLog(events)
    bar = progress_bar(
        total=len(ids), initial=len(resumed), desc="extract", unit="sample", enabled=progress
    )
    received = _Received(writer, bar, log, t0, on_sample)
    consumers: list[StreamConsumer] = []
    stats: list[StreamStats] = []
    # SIGTERM unwinds like Ctrl-C: the producers sit in sessions of their own (so that the
    # trainer can outlive a group signal), and leaving this block is what stops them.
    with ExitStack() as stack:
        stack.enter_context(exit_on_sigterm())
        if len(resumed) < len(ids):  # else every sample is on disk: no stream to start
            st = stack.enter_context(
                open_stream(
                    params,
                    target_dir=target_dir,
                    shards_dir=shards_dir,
                    sample_ids=ids,
                    consumed=set(resumed),
                    producer_overrides=producer_overrides,
                )
            )
            consumers = st.consumers(fetch_timeout=x.fetch_timeout, idle_timeout=x.idle_timeout)
            _drain_in_threads(consumers, received)
            stats = [c.stats for c in st.coordinators]
        bar.close()
    wall = time.perf_counter() - t0
    attempts = writer.all_attempts()
    doc = writer.close(_how_extracted(params, target_dir))
    return _stage_metrics(
        params,
        ids=ids,
        resumed=resumed,
        received=received,
        stats=stats,
        consumers=consumers,
        attempts=attempts,
        samples=doc["samples"],
        wall=wall,
    )


def _how_extracted(params: Params, target_dir: Path) -> dict:
    """The hidden-state manifest's record of how its states were captured and sent."""
    x = params.extract
    return {
        "transport": x.transport,
        "mode": x.mode,
        "wire_dtype": x.wire_dtype,
        "aux_layers": resolve_aux_layers(x.aux_layers, _num_layers(target_dir)),
    }


def _stage_metrics(
    params: Params,
    *,
    ids: list[int],
    resumed: set[int],
    received: _Received,
    stats: list[StreamStats],
    consumers: list[StreamConsumer],
    attempts: list[dict],
    samples: list[dict],
    wall: float,
) -> dict:
    """The stage's metrics: delivery counts, the stream's repairs, throughput, and what the
    output holds. `samples` are the output's sample entries, resumed ones included."""
    x = params.extract
    got = received.sample_ids
    tokens = received.tokens
    bytes_received = sum(c.bytes_received for c in consumers)
    return {
        "transport": x.transport,
        "mode": x.mode,
        "workers": x.workers,
        "consumers": x.consumers,
        "samples_expected": len(ids),
        "samples_received": len(got),
        "resumed_samples": len(resumed),  # kept from an earlier, stopped run of the stage
        "lost": len(set(ids) - set(got) - resumed),
        "duplicated": len(got) - len(set(got)),
        "duplicates_dropped": sum(s.duplicates_dropped for s in stats),
        "reassigned": sum(s.reassigned for s in stats),
        "resent_after_error": sum(s.resent_after_error for s in stats),
        "producers_lost": sum(s.producers_lost for s in stats),
        "stale_turned_away": sum(s.stale_turned_away for s in stats),
        # The whole output, resumed samples included; the rates below are this run's alone.
        "tokens": sum(e["tokens"] for e in samples),
        "response_tokens": sum(e["response_tokens"] for e in samples),
        "tokens_this_run": tokens,
        "attempts": len(attempts),
        "wall_s_all_attempts": round(sum(a["wall_s"] for a in attempts), 2),
        # Answered here: prompt and response tokens with their states per wall-second, the
        # whole on-policy data plane. Else the answers came from prepare and this is capture.
        "answered_here": params.prepare.engine == "extract",
        "onpolicy_tok_s": round(tokens / wall, 1) if params.prepare.engine == "extract" else None,
        "tok_s": round(tokens / wall, 1),
        "first_sample_s": None if received.first_s is None else round(received.first_s, 2),
        "bytes_received": bytes_received,
        "mb_per_s": round(bytes_received / 1e6 / wall, 2),
        "consumer_wait_fraction": round(
            sum(c.wait_s for c in consumers) / max(1, len(consumers)) / wall, 4
        ),
        "wall_s": round(wall, 2),
        # What was extracted, apart from how: equal fingerprints, equal data.
        "content": fingerprints(samples),
    }
