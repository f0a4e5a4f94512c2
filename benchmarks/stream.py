"""Stream benchmark: bytes per token, transport throughput and CPU cost, and a live stream.

    python -m benchmarks.stream [--profile P] [--repeats 3] [--samples 16]

Needs the prepare stage's outputs (artifacts/target, artifacts/shards; or `--target` and
`--shards`). Payloads are real captured samples. Transports are measured side by side,
alternating A B C A B C, each between two processes on loopback; figures carry their spread over
the repeats. `--engine-seconds` is how long Mooncake's own transfer_engine_bench runs. Prints a
table and writes metrics/studies/stream.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.config import load_params
from dspark.data.shards import iter_samples
from dspark.extract.capture import HiddenStateCapture, resolve_aux_layers
from dspark.extract.stage import MOONCAKE_ENV, open_stream
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target
from dspark.schema import WIRE_DTYPES, Sample
from dspark.transport.master import MooncakeMaster, master_binary
from dspark.transport.stores import FileStore, MooncakeStore
from dspark.transport.stream import StreamConsumer
from dspark.transport.wire import make_manifest

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
FETCH_BATCH = 8
SEGMENT_BYTES = 256 << 20  # extract.segment_mb's default


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- the sending side, run as a separate process ----------------------------------------------


def _send(transport: str, payload_file: str, arg: str, out: str) -> None:
    tensors = load_file(payload_file)
    ids = sorted({int(k.split("/")[0]) for k in tensors})
    samples = [
        Sample.from_tensors(
            i, {k.split("/")[1]: v for k, v in tensors.items() if k.startswith(f"{i}/")}
        )
        for i in ids
    ]
    c0 = cpu_s()
    manifests = []
    if transport == "socket":
        host, port = arg.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            for sample in samples:
                for t in sample.tensors().values():
                    s.sendall(t.contiguous().view(-1).view(torch.uint8).numpy())
    else:
        store = (
            MooncakeStore(arg, segment_bytes=SEGMENT_BYTES, buffer_bytes=16 << 20)
            if transport == "mooncake"
            else FileStore(Path(arg))
        )
        # Steady state, as in a long stream: one unmeasured pass touches the segment's pages
        # (first writes into fresh pages cost page faults) and sets up the staging buffer.
        for sample in samples:
            warm = make_manifest(sample, f"warm/{os.getpid()}/{sample.sample_id}")
            store.put(warm, sample.tensors())
            store.delete(warm["handle"])
        c0 = cpu_s()
        for sample in samples:
            manifest = make_manifest(sample, f"bench/{os.getpid()}/{sample.sample_id}")
            store.put(manifest, sample.tensors())
            manifests.append(manifest)
    Path(out).write_text(json.dumps({"cpu_s": cpu_s() - c0, "manifests": manifests}))
    if transport == "mooncake":
        time.sleep(600)  # the payloads live in this process's memory until the reader is done


def _receive(
    transport: str, samples: list[Sample], payload_file: Path, workdir: Path, master: str
) -> dict:
    total = sum(s.nbytes() for s in samples)
    out = workdir / f"send-{transport}.json"
    out.unlink(missing_ok=True)
    if transport == "socket":
        server = socket.create_server(("127.0.0.1", 0))
        arg = f"127.0.0.1:{server.getsockname()[1]}"
    else:
        arg = master if transport == "mooncake" else str(workdir / "files")
    sender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.stream",
            "--send",
            transport,
            str(payload_file),
            arg,
            str(out),
        ],
        cwd=ROOT,
    )
    try:
        if transport == "socket":
            conn, _ = server.accept()
            buf = torch.empty(total, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            c0, t0, got = cpu_s(), time.perf_counter(), 0
            while got < total:
                n = conn.recv_into(view[got:], min(1 << 22, total - got))
                if not n:
                    break
                got += n
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
            conn.close()
            server.close()
            sender.wait(60)
            send_cpu = json.loads(out.read_text())["cpu_s"]
        else:
            while not out.exists():
                if sender.poll() is not None:
                    raise RuntimeError(f"{transport} sender exited {sender.returncode}")
                time.sleep(0.01)
            report = json.loads(out.read_text())
            store = (
                MooncakeStore(master, segment_bytes=0, buffer_bytes=64 << 20)
                if transport == "mooncake"
                else FileStore(workdir / "files")
            )
            store.get(report["manifests"][0], 10)  # connect and warm up outside the clock
            c0, t0 = cpu_s(), time.perf_counter()
            manifests = report["manifests"]
            for i in range(0, len(manifests), FETCH_BATCH):  # as StreamConsumer fetches
                for got in store.get_many(manifests[i : i + FETCH_BATCH], 10):
                    if isinstance(got, Exception):
                        raise got
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
            send_cpu = report["cpu_s"]
            for m in report["manifests"]:
                if transport == "files":
                    store.delete(m["handle"])
    finally:
        sender.kill()
        sender.wait()
    # The receive side is timed; the CPU cost counts both ends.
    return {"gbps": total / wall / GB, "cpu_s_per_gb": (cpu + send_cpu) / (total / GB)}


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * nbytes / (time.perf_counter() - t0) / GB


def engine_bench_gbps(seconds: int = 5, threads: int = 4) -> float | None:
    """Mooncake's own transfer_engine_bench (C++): a target and an initiator on loopback."""
    import re

    binary = master_binary().parent / "transfer_engine_bench"
    if not binary.exists():
        return None
    common = ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--local_server_name=127.0.0.1"]
    # Its results are INFO log lines: unbuffered, and not silenced by our MC_LOG_LEVEL.
    env = {**os.environ, "GLOG_logbuflevel": "-1", "MC_LOG_LEVEL": "INFO"}
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        target = subprocess.Popen(
            [str(binary), "--mode=target", *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            segment = None
            for _ in range(200):  # its P2P handshake address is only in its log
                time.sleep(0.1)
                found = re.search(r"listening on (\S+:\d+)", Path(log.name).read_text())
                if found:
                    segment = found.group(1)
                    break
            if segment is None:
                return None
            res = subprocess.run(
                [
                    str(binary),
                    "--mode=initiator",
                    f"--segment_id={segment}",
                    f"--duration={seconds}",
                    "--operation=write",
                    f"--threads={threads}",
                    *common,
                ],
                capture_output=True,
                text=True,
                timeout=seconds + 60,
                env=env,
            )
            found = re.search(r"throughput ([0-9.]+) GB/s", res.stdout + res.stderr)
            return float(found.group(1)) if found else None
        finally:
            target.kill()
            target.wait()


def stall_fraction(params, samples_dir: Path, target_dir: Path, width: int) -> dict:
    """A live stream of real producers into a consumer that trains on each sample.

    Stand-in step until issue 4's trainer exists: forward and backward of one Llama decoder
    layer at the target's width over the sample's hidden states (the DSpark draft is 1-2 such
    layers). The stall fraction is the consumer's time waiting for data over its total.
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 192),
    )
    layer, rope = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    manifest = json.loads((samples_dir / "manifest.json").read_text())
    ids = list(range(manifest["num_samples"]))
    t0 = time.perf_counter()
    with open_stream(
        params, target_dir=target_dir, shards_dir=samples_dir, sample_ids=ids
    ) as stream:
        # The stage's own patience: producers still loading the target on a busy machine have
        # not connected yet, and the transport's default 120 s gave up on them.
        x = params.extract
        consumer = StreamConsumer(
            stream.coordinator,
            stream.store,
            fetch_timeout=x.fetch_timeout,
            idle_timeout=x.idle_timeout,
        )
        received = []
        for sample in consumer:
            h = sample.aux_hidden[-1].float()[None]  # [1, S, H]
            pos = torch.arange(h.shape[1])[None]
            out = layer(h, position_embeddings=rope(h, pos), attention_mask=None)
            (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            received.append(sample.sample_id)
        stats = stream.coordinator.stats
    wall = time.perf_counter() - t0
    return {
        "samples_sent": len(ids),
        "samples_received": len(received),
        "lost": len(set(ids) - set(received)),
        "duplicated": len(received) - len(set(received)),
        "reassigned": stats.reassigned,
        "consumer_stall_fraction": round(consumer.wait_s / wall, 4),
        "stream_wall_s": round(wall, 2),
        "producers": params.extract.workers,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--send":
        _send(*argv[1:5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument(
        "--engine-seconds", type=int, default=5, help="how long transfer_engine_bench runs"
    )
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument("--shards", type=Path, default=ROOT / "artifacts" / "shards")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "stream.json")
    args = ap.parse_args(argv)
    for k, v in MOONCAKE_ENV.items():
        os.environ.setdefault(k, v)

    params = load_params(ROOT / "params.yaml", profile=args.profile)
    x = params.extract
    target_dir, shards_dir = args.target, args.shards
    target = load_target(target_dir)
    aux = resolve_aux_layers(x.aux_layers, target.num_layers)
    capture = HiddenStateCapture(target, aux, x.wire_dtype, topk=20)
    samples = [
        capture(s) for _, s in zip(range(args.samples), iter_samples(shards_dir), strict=False)
    ]
    capture.close()
    tokens = sum(s.num_tokens for s in samples)
    size = WIRE_DTYPES[x.wire_dtype].itemsize
    hidden_only = [
        Sample(s.sample_id, s.input_ids, s.loss_mask, s.aux_hidden, s.last_hidden) for s in samples
    ]
    bpt_hidden = sum(s.nbytes() for s in hidden_only) / tokens
    bpt_topk = sum(s.nbytes() for s in samples) / tokens
    bpt_full = 4 + 1 + target.vocab_size * size

    results: dict[str, list[dict]] = {"mooncake": [], "files": [], "socket": []}
    with (
        tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp,
        MooncakeMaster.start() as master,
    ):
        workdir = Path(tmp)
        payload_file = workdir / "payloads.safetensors"
        save_file(
            {
                f"{s.sample_id}/{k}": t.contiguous()
                for s in hidden_only
                for k, t in s.tensors().items()
            },
            str(payload_file),
        )
        for _ in range(args.repeats):  # A B C A B C: the machine's noise hits all alike
            for transport in results:
                results[transport].append(
                    _receive(transport, hidden_only, payload_file, workdir, master.address)
                )

    def med(t, k):
        return statistics.median(r[k] for r in results[t])

    def spread(t, k):
        vals = [r[k] for r in results[t]]
        return [round(min(vals), 3), round(max(vals), 3)]

    live = stall_fraction(params, shards_dir, target_dir, target.hidden_size)
    doc = {
        "cpu": cpu_features(),
        "transport": x.transport,
        "wire_dtype": x.wire_dtype,
        "payload_samples": len(samples),
        "payload_mb": round(sum(s.nbytes() for s in hidden_only) / 1e6, 2),
        "bytes_per_token": {
            "hidden": round(bpt_hidden, 1),
            "topk_logits": round(bpt_topk, 1),
            "full_logits": bpt_full,
            "topk": 20,
        },
        "full_over_hidden": round(bpt_full / bpt_hidden, 2),
        "mooncake_gbps": round(med("mooncake", "gbps"), 3),
        "mooncake_gbps_range": spread("mooncake", "gbps"),
        "engine_bench_gbps": engine_bench_gbps(args.engine_seconds),
        "socket_gbps": round(med("socket", "gbps"), 3),
        "socket_gbps_range": spread("socket", "gbps"),
        "files_gbps": round(med("files", "gbps"), 3),
        "memcpy_gbps": round(memcpy_gbps(), 2),
        "cpu_s_per_gb": {t: round(med(t, "cpu_s_per_gb"), 3) for t in results},
        "cpu_s_per_gb_range": {t: spread(t, "cpu_s_per_gb") for t in results},
        "mooncake_cpu_over_socket": round(
            med("mooncake", "cpu_s_per_gb") / med("socket", "cpu_s_per_gb"), 2
        ),
        "repeats": args.repeats,
        **live,
        "stall_step": "stand-in: one Llama decoder layer fwd+bwd at the target width",
    }
    write_metrics(args.out, params.profile, doc)
    print(f"{'transport':<10} {'GB/s':>8} {'range':>16} {'CPU s/GB':>9}")
    for t in results:
        print(
            f"{t:<10} {med(t, 'gbps'):>8.3f} {spread(t, 'gbps')!s:>16} "
            f"{med(t, 'cpu_s_per_gb'):>9.3f}"
        )
    print(
        f"memcpy {doc['memcpy_gbps']} GB/s; transfer_engine_bench {doc['engine_bench_gbps']} GB/s"
    )
    print(
        f"bytes/token: hidden {doc['bytes_per_token']['hidden']}, top-20 "
        f"{doc['bytes_per_token']['topk_logits']}, full logits {bpt_full} "
        f"({doc['full_over_hidden']}x hidden)"
    )
    print(
        f"live stream: {live['samples_received']}/{live['samples_sent']} samples, lost "
        f"{live['lost']}, duplicated {live['duplicated']}, consumer stall "
        f"{live['consumer_stall_fraction']:.1%} with {live['producers']} producers"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
