"""Hidden states streamed from real producer processes to a consumer, over Mooncake on loopback,
with the faults the protocol must survive."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark.config import load_params
from dspark.data.prepare import PreparePaths, prepare_stage
from dspark.data.shards import TokenSample, iter_samples
from dspark.errors import ResourceError
from dspark.extract.capture import HiddenStateCapture
from dspark.extract.content import differing
from dspark.extract.producer import ProducerConfig
from dspark.extract.stage import extract_stage, open_stream
from dspark.transport.files import iter_hidden
from dspark.transport.stores import TransportError
from dspark.transport.stream import StreamConsumer, batches

from ..conftest import ROOT, skip_or_fail, write_jsonl

pytestmark = pytest.mark.slow
NUM = 24


@pytest.fixture(scope="module")
def prepared(tiny_target, tiny_target_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepared")
    train = folder / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"category": "t", "prompt": f"Say something about item {i}."}) + "\n"
            for i in range(NUM + 4)
        )
    )
    params = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            f"data.train_sources=[{train}]",
            f"prepare.num_samples={NUM}",
            "prepare.shard_size=8",
            "data.eval_counts={qa: 1}",
            "prepare.max_new_tokens=8",
            "prepare.engine=hf",  # answered shards: these tests are the transport's
        ],
    )
    paths = PreparePaths(
        target=tiny_target_dir, shards=folder / "shards", eval_prompts=folder / "eval.jsonl"
    )
    prepare_stage(params, tiny_target, paths, progress=False)
    return paths.shards


def stream_params(*sets):
    return load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            "prepare.engine=hf",  # the credits are max_in_flight's
            "extract.workers=2",
            "extract.max_in_flight=6",
            "extract.heartbeat_timeout=2",
            "extract.fetch_timeout=6",
            "extract.wire_dtype=float32",
            *sets,
        ],
    )


def expected_samples(tiny_target, shards, aux):
    """What the producers must deliver: the full forward's states and the target's top-k, as
    `stream_params` configures them."""
    capture = HiddenStateCapture(tiny_target, aux, "float32", stream_params().extract.target_topk)
    try:
        return {s.sample_id: capture(s) for s in iter_samples(shards)}
    finally:
        capture.close()


def assert_exact(received, expected):
    assert [s.sample_id for s in received] == sorted(expected)  # every sample, once, in order
    for s in received:
        for name, tensor in s.tensors().items():
            assert torch.equal(tensor, expected[s.sample_id].tensors()[name]), name


def consume(params, tiny_target_dir, shards, overrides=None, on_sample=None, consumed=None):
    ids = list(range(NUM))
    with open_stream(
        params,
        target_dir=tiny_target_dir,
        shards_dir=shards,
        sample_ids=ids,
        consumed=consumed,
        producer_overrides=overrides,
    ) as stream:
        consumer = StreamConsumer(
            stream.coordinator, stream.store, fetch_timeout=6, idle_timeout=60
        )
        out = []
        for sample in consumer:
            out.append(sample)
            if on_sample:
                on_sample(len(out), stream)
        return out, stream.coordinator.stats


def test_two_producers_over_mooncake_every_sample_verified(
    tiny_target, tiny_target_dir, prepared, tmp_path
):
    params = stream_params("extract.mode=hybrid")
    metrics = extract_stage(
        params,
        target_dir=tiny_target_dir,
        shards_dir=prepared,
        out_dir=tmp_path / "hidden",
        progress=False,
    )
    assert metrics["samples_received"] == NUM and metrics["lost"] == 0
    assert metrics["duplicated"] == 0 and metrics["transport"] == "mooncake"
    assert_exact(
        list(iter_hidden(tmp_path / "hidden")), expected_samples(tiny_target, prepared, [0, 1])
    )
    sizes = [len(b) for b in batches(iter_hidden(tmp_path / "hidden"), 5)]
    assert sizes == [5, 5, 5, 5, 4]


def test_producers_answer_prompts_as_they_capture(tiny_target, tiny_target_dir, tmp_path):
    """prepare.engine extract: the shards hold prompts; two producers answer them (4 rows each,
    refilled as rows end) and stream tokens and states in one pass. Every answer is the target's
    greedy one (teacher-forced against transformers), and every state a full forward's."""
    from dspark.decode.reference import TIE, Reference

    params, paths, prepared = answered_here(tiny_target, tiny_target_dir, tmp_path)
    assert prepared["response_tokens"] == 0 and prepared["gen_tok_s"] is None
    metrics = extract_stage(
        params,
        target_dir=tiny_target_dir,
        shards_dir=paths.shards,
        out_dir=tmp_path / "hidden",
        progress=False,
    )
    assert metrics["samples_received"] == NUM and metrics["answered_here"]
    assert metrics["onpolicy_tok_s"] > 0 and 0 < metrics["response_tokens"] <= 6 * NUM
    prompts = {s.sample_id: s.input_ids.tolist() for s in iter_samples(paths.shards)}
    got = list(iter_hidden(tmp_path / "hidden"))
    assert [s.sample_id for s in got] == list(range(NUM))
    paths_, prompts_ = [], []
    capture = HiddenStateCapture(tiny_target, [0, 1], "float32")
    for s in got:
        prompt, ids = prompts[s.sample_id], s.input_ids.tolist()
        assert ids[: len(prompt)] == prompt and 1 <= len(ids) - len(prompt) <= 6
        assert s.loss_mask.tolist() == [i >= len(prompt) for i in range(len(ids))]
        full = capture(TokenSample(s.sample_id, "", s.input_ids, s.loss_mask))
        assert torch.allclose(s.aux_hidden, full.aux_hidden, atol=1e-4)
        assert torch.allclose(s.last_hidden, full.last_hidden, atol=1e-4)
        prompts_.append(prompt)
        paths_.append(ids[len(prompt) :])
    capture.close()
    for row in Reference(tiny_target).check_batch(prompts_, paths_):
        assert all(margin < TIE for _, margin in row), row  # at most ties, never a divergence


def answered_here(tiny_target, tiny_target_dir, tmp_path):
    """Prompts that the producers answer (prepare.engine extract), prepared: (params, paths,
    prepare's metrics)."""
    train = tmp_path / "train.jsonl"
    write_jsonl(
        train, [{"category": "t", "prompt": f"Describe place {i} briefly."} for i in range(NUM)]
    )
    params = stream_params(
        f"data.train_sources=[{train}]",
        f"prepare.num_samples={NUM}",
        "prepare.shard_size=8",
        "data.eval_counts={qa: 1}",
        "prepare.max_new_tokens=6",
        "prepare.engine=extract",
        "extract.mode=offline",
        "extract.decode_rows=4",
    )
    paths = PreparePaths(
        target=tiny_target_dir, shards=tmp_path / "shards", eval_prompts=tmp_path / "eval.jsonl"
    )
    return params, paths, prepare_stage(params, tiny_target, paths, progress=False)


def extract_into(params, tiny_target_dir, paths, out, overrides=None) -> dict:
    return extract_stage(
        params,
        target_dir=tiny_target_dir,
        shards_dir=paths.shards,
        out_dir=out,
        progress=False,
        producer_overrides=overrides,
    )


def test_two_extractions_give_the_same_content_however_the_producers_run(
    tiny_target, tiny_target_dir, tmp_path
):
    """Issue 50's reproducibility: the same prompts answered and captured by two producers, then
    by one producer of two slowed down (so the other takes most prompts, in other batches),
    then by one producer alone: the same token ids and bit-identical states, so the same
    content fingerprints, while the shards' arrival differs."""
    params, paths, _ = answered_here(tiny_target, tiny_target_dir, tmp_path)
    alone = params.model_copy(update={"extract": params.extract.model_copy(update={"workers": 1})})
    runs = {
        "two": (params, None),
        "one_slow": (params, lambda i: {"throttle_s": 0.3} if i == 0 else {}),
        "alone": (alone, None),
    }
    content = {}
    for name, (p, overrides) in runs.items():
        metrics = extract_into(p, tiny_target_dir, paths, tmp_path / name, overrides)
        assert metrics["samples_received"] == NUM and metrics["lost"] == 0
        content[name] = metrics["content"]
    assert content["two"]["tokens"] is not None and content["two"]["samples"] == NUM
    assert content["one_slow"] == content["two"] == content["alone"]
    entries = {
        name: json.loads((tmp_path / name / "manifest.json").read_text())["samples"]
        for name in runs
    }
    assert differing(entries["two"], entries["one_slow"]) == {
        "shared": NUM, "only_one": 0, "tokens": 0, "states_summary": 0, "states_exact": 0
    }  # fmt: skip


def test_a_full_disk_stops_extraction_in_one_line_and_it_resumes_once_space_is_back(
    tiny_target, tiny_target_dir, tmp_path, small_disk
):
    """The shards on a disk with room for about half of them: the stage stops with one line
    naming the shard and the bytes it needed, leaves no half-written file, and run again with
    space back it keeps the shards it finished and ends with the same content as a run that
    never ran short."""
    params, paths, _ = answered_here(tiny_target, tiny_target_dir, tmp_path)
    shards = {"shard_size": 4}  # six shards: some fit, some do not
    params = params.model_copy(update={"extract": params.extract.model_copy(update=shards)})
    whole = extract_into(params, tiny_target_dir, paths, tmp_path / "whole")
    size = sum(f.stat().st_size for f in (tmp_path / "whole").iterdir())
    out = small_disk.mount(size // 2) / "hidden"
    with pytest.raises(ResourceError) as e:
        extract_into(params, tiny_target_dir, paths, out)
    msg = str(e.value)
    assert "\n" not in msg and re.match(rf"^{out}/hidden-\d+\.safetensors: no space left", msg)
    assert "bytes to write" in msg
    assert not [f for f in out.iterdir() if f.name.startswith(".") or f.suffix == ".tmp"]
    kept = json.loads((out / "resume.json").read_text())["samples"]
    assert 0 < len(kept) < NUM

    small_disk.mount(size * 3)
    metrics = extract_into(params, tiny_target_dir, paths, out)
    assert metrics["resumed_samples"] == len(kept) and metrics["lost"] == 0
    assert metrics["content"] == whole["content"]  # every sample once, as an unhurried run


class Stop(Exception):
    pass


def test_the_stage_waits_for_a_first_sample_as_long_as_extract_idle_timeout_says(
    tiny_target_dir, prepared, tmp_path
):
    """Producers that answer their prompts send nothing for minutes at first: the stage's
    consumers wait `extract.idle_timeout` (here shorter than a producer's start-up) and then
    fail the stream, naming the wait."""
    params = stream_params("extract.mode=offline", "extract.idle_timeout=0.5")
    with pytest.raises(TransportError, match=r"^stream: nothing received for 0\.5 s, and no"):
        extract_stage(
            params,
            target_dir=tiny_target_dir,
            shards_dir=prepared,
            out_dir=tmp_path / "hidden",
            progress=False,
        )


def test_a_stopped_extraction_resumes_after_its_last_shard(
    tiny_target, tiny_target_dir, prepared, tmp_path
):
    """Stopped at the 10th sample with shards of 4: the rerun keeps 8, streams only the other
    16, and the result is what one uninterrupted run writes."""
    params = stream_params("extract.mode=offline", "extract.shard_size=4")
    out = tmp_path / "hidden"

    def stop_at_tenth(sample):
        if sample.sample_id == 9:
            raise Stop

    with pytest.raises(Stop):
        extract_stage(
            params,
            target_dir=tiny_target_dir,
            shards_dir=prepared,
            out_dir=out,
            progress=False,
            on_sample=stop_at_tenth,
        )
    metrics = extract_stage(
        params, target_dir=tiny_target_dir, shards_dir=prepared, out_dir=out, progress=False
    )
    assert metrics["resumed_samples"] == 8 and metrics["samples_received"] == NUM - 8
    assert metrics["lost"] == 0 and metrics["attempts"] == 2
    assert metrics["tokens"] > metrics["tokens_this_run"] > 0
    assert_exact(list(iter_hidden(out)), expected_samples(tiny_target, prepared, [0, 1]))

    # Finished, then run again (DVC reruns it when its code changes): every shard is kept, and
    # no producer starts.
    manifest = (out / "manifest.json").read_bytes()
    again = extract_stage(
        params, target_dir=tiny_target_dir, shards_dir=prepared, out_dir=out, progress=False
    )
    assert again["resumed_samples"] == NUM and again["samples_received"] == 0
    assert again["lost"] == 0 and (out / "manifest.json").read_bytes() == manifest


def test_killed_producer_samples_are_reassigned(tiny_target, tiny_target_dir, prepared):
    def kill_first(n, stream):
        # Once both producers have joined (a slow starter could otherwise miss the stream).
        if not killed and stream.coordinator.live_producers() == 2:
            stream.producers[0].kill()
            killed.append(n)

    killed = []

    params = stream_params()
    out, stats = consume(
        params,
        tiny_target_dir,
        prepared,
        on_sample=kill_first,
        overrides=lambda i: {"throttle_s": 0.3},
    )
    assert killed and stats.producers_lost >= 1
    assert_exact(out, expected_samples(tiny_target, prepared, [0, 1]))


def consume_stopping(tiny_target_dir, prepared, on_sample, state: dict):
    """`consume` with slow producers (0.3 s a sample), `on_sample` free to SIGSTOP one and note
    its pid in `state["pid"]`: whatever happens, that producer is continued afterwards."""
    try:
        return consume(
            stream_params(),
            tiny_target_dir,
            prepared,
            on_sample=on_sample,
            overrides=lambda i: {"throttle_s": 0.3},
        )
    finally:
        if "pid" in state:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state["pid"], signal.SIGCONT)


def test_stopped_producer_is_detected_and_its_samples_reassigned(
    tiny_target, tiny_target_dir, prepared
):
    # Stopped early and with slow producers, the other producer alone needs ~7 s for the rest:
    # the stream cannot finish before the stopped one is found out (2 s heartbeat timeout).
    stopped = {}

    def freeze_first(n, stream):
        # Once both producers have joined (a slow starter could otherwise miss the stream).
        if "at" not in stopped and stream.coordinator.live_producers() == 2:
            os.kill(stream.producers[0].pid, signal.SIGSTOP)
            stopped["at"] = time.monotonic()
            stopped["pid"] = stream.producers[0].pid

    out, stats = consume_stopping(tiny_target_dir, prepared, freeze_first, stopped)
    assert "at" in stopped and stats.producers_lost >= 1
    assert stats.lost_at[0] - stopped["at"] < 10  # detected within 10 s, not a 60 s hang
    assert_exact(out, expected_samples(tiny_target, prepared, [0, 1]))


def test_a_stopped_producer_that_wakes_mid_stream_duplicates_nothing(
    tiny_target, tiny_target_dir, prepared
):
    """SIGSTOP, found out and its samples reassigned, then SIGCONT while the other producer is
    still streaming: whatever the woken one still holds or sends (stored samples, heartbeats,
    a reconnect) must not reach the trainer twice. Every sample arrives exactly once, exact."""
    state = {}

    def freeze_then_wake(n, stream):
        c = stream.coordinator
        if "pid" not in state and c.live_producers() == 2:
            state["pid"] = stream.producers[0].pid
            os.kill(state["pid"], signal.SIGSTOP)
        elif "pid" in state and "woke_at" not in state and c.stats.producers_lost >= 1:
            os.kill(state["pid"], signal.SIGCONT)  # its samples went elsewhere meanwhile
            state["woke_at"] = n

    out, stats = consume_stopping(tiny_target_dir, prepared, freeze_then_wake, state)
    assert "woke_at" in state and state["woke_at"] < NUM  # woken while the stream still ran
    assert stats.producers_lost >= 1 and stats.reassigned >= 1
    assert_exact(out, expected_samples(tiny_target, prepared, [0, 1]))


def test_corrupted_payload_is_caught_and_resent(tiny_target, tiny_target_dir, prepared):
    params = stream_params()
    # Whichever producer is assigned sample 5 flips a byte of it, once per producer.
    out, stats = consume(
        params, tiny_target_dir, prepared, overrides=lambda i: {"corrupt_sample": 5}
    )
    assert 1 <= stats.resent_after_error <= 2
    assert_exact(out, expected_samples(tiny_target, prepared, [0, 1]))


def test_consumer_restart_resumes_after_its_checkpoint(tiny_target, tiny_target_dir, prepared):
    params = stream_params()
    first, _ = consume(params, tiny_target_dir, prepared)
    checkpoint = {s.sample_id for s in first[:10]}  # what a trainer had consumed
    rest, _ = consume(params, tiny_target_dir, prepared, consumed=checkpoint)
    assert [s.sample_id for s in rest] == list(range(10, NUM))
    assert_exact(first[:10] + rest, expected_samples(tiny_target, prepared, [0, 1]))


def test_wrong_peer_fails_fast_with_one_line(tmp_path, tiny_target_dir, prepared):
    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = ProducerConfig(
        name="p",
        coordinators=[f"127.0.0.3:{port}"],
        run_id="x",
        target_dir=str(tiny_target_dir),
        shards_dir=str(prepared),
        aux_layers=[0],
        wire_dtype="float32",
        topk=0,
        store="files",
        files_dir=str(tmp_path),
        connect_timeout=5,
    )
    path = tmp_path / "p.json"
    cfg.dump(path)
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "dspark.extract.producer", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # connect_timeout bounds the wait (5 s); the rest is the interpreter and torch starting,
    # which take seconds on a loaded 2-core machine.
    assert time.monotonic() - t0 < 30
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the stream coordinator at 127.0.0.3" in lines[0]


def listeners() -> list[tuple[str, int, str]]:
    """(address, port, owning pids) of every TCP listener, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        addr, port = parts[3].rsplit(":", 1)
        rows.append((addr.strip("[]"), int(port), " ".join(parts[5:])))
    return rows


def test_what_our_endpoints_bind(tiny_target_dir, prepared, caplog):
    """The coordinator and mooncake_master bind loopback only. Mooncake's transfer engine binds
    its data port on all interfaces whatever host it is given (no option to change it): the
    README documents that exposure, and this test pins exactly which ports it is."""
    params = stream_params("extract.workers=1")
    with open_stream(
        params, target_dir=tiny_target_dir, shards_dir=prepared, sample_ids=list(range(NUM))
    ) as stream:
        consumer = iter(StreamConsumer(stream.coordinator, stream.store))
        next(consumer)  # producers and the consumer's store are up
        pids = {str(os.getpid()), *(str(p.pid) for p in stream.producers)}
        master_pid = str(stream.master.process.pid)
        ours = [
            (a, p, who)
            for a, p, who in listeners()
            if any(f"pid={pid}," in who for pid in (*pids, master_pid))
        ]
        coord_port = int(stream.coordinator.address.rsplit(":", 1)[1])
        by_port = {p: a for a, p, _ in ours}
        assert by_port[coord_port] == "127.0.0.1"
        master_ports = {p for a, p, who in ours if f"pid={master_pid}," in who}
        assert master_ports and all(by_port[p] == "127.0.0.1" for p in master_ports)
        exposed = [(a, p, who) for a, p, who in ours if a not in ("127.0.0.1", "::1")]
        # Only Mooncake transfer-engine listeners of the store clients, never ours.
        assert all(p != coord_port and p not in master_ports for _, p, _ in exposed)
    with caplog.at_level("WARNING"):
        from dspark.transport.control import warn_if_exposed

        warn_if_exposed("0.0.0.0", "the stream coordinator")
    assert "no authentication" in caplog.text


def test_killed_consumer_restarts_and_producers_reconnect(
    tiny_target, tiny_target_dir, prepared, tmp_path
):
    from dspark.net import free_port
    from dspark.transport.control import Coordinator
    from dspark.transport.master import MooncakeMaster
    from dspark.transport.stores import MooncakeStore

    ids_file = tmp_path / "consumed.txt"
    ids_file.write_text("")
    port = free_port()
    with MooncakeMaster.start() as master:
        producers = []
        for i in range(2):
            cfg = ProducerConfig(
                name=f"p{i}",
                coordinators=[f"127.0.0.1:{port}"],
                run_id="r",
                target_dir=str(tiny_target_dir),
                shards_dir=str(prepared),
                aux_layers=[0, 1],
                wire_dtype="float32",
                topk=0,
                store="mooncake",
                master=master.address,
                throttle_s=0.1,
                connect_timeout=30,
                reconnect_for=30,
            )
            cfg.dump(tmp_path / f"p{i}.json")
            producers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dspark.extract.producer",
                        str(tmp_path / f"p{i}.json"),
                    ]
                )
            )
        try:
            first = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration.consumer_proc",
                    master.address,
                    str(port),
                    str(ids_file),
                    str(NUM),
                ],
                cwd=ROOT,
            )
            deadline = time.monotonic() + 60
            while len(ids_file.read_text().split()) < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            first.kill()  # the consumer dies mid-stream; its checkpoint is what it recorded
            first.wait()
            consumed = [int(x) for x in ids_file.read_text().split()]
            assert len(consumed) >= 8
            coordinator = Coordinator(
                list(range(NUM)),
                consumed=set(consumed),
                port=port,
                max_in_flight=4,
                heartbeat_timeout=3,
            )
            # Both must come back (the point of the test), and before the stream drains: a
            # loaded machine can finish it with one producer while the other is still away.
            deadline = time.monotonic() + 30  # at most their reconnect_for, counted from the kill
            while coordinator.live_producers() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert coordinator.live_producers() == 2
            store = MooncakeStore(master.address, segment_bytes=0, buffer_bytes=16 << 20)
            rest = list(StreamConsumer(coordinator, store, idle_timeout=60))
            coordinator.close()
            for p in producers:
                p.wait(20)  # they finish on `done`: under reconnect_for, or a lost one passes
        finally:
            for p in producers:
                if p.poll() is None:
                    p.kill()
    assert consumed == list(range(len(consumed)))
    assert [s.sample_id for s in rest] == list(range(len(consumed), NUM))
    expected = expected_samples(tiny_target, prepared, [0, 1])
    assert_exact(rest, {k: v for k, v in expected.items() if k >= len(consumed)})


def test_two_consumers_each_get_their_rank_in_order(
    tiny_target, tiny_target_dir, prepared, tmp_path
):
    """One consumer per trainer rank: every producer serves both, each rank's ids arrive in
    order, and together they cover every sample exactly once."""
    import threading

    params = stream_params("extract.consumers=2")
    got: dict[int, list] = {0: [], 1: []}
    with open_stream(
        params, target_dir=tiny_target_dir, shards_dir=prepared, sample_ids=list(range(NUM))
    ) as stream:
        consumers = stream.consumers(fetch_timeout=6, idle_timeout=60)
        threads = [threading.Thread(target=lambda r=r: got[r].extend(consumers[r])) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert [s.sample_id for s in got[0]] == list(range(0, NUM, 2))
    assert [s.sample_id for s in got[1]] == list(range(1, NUM, 2))
    assert_exact(
        sorted(got[0] + got[1], key=lambda s: s.sample_id),
        expected_samples(tiny_target, prepared, [0, 1]),
    )


def test_our_objects_are_hs_connectors_objects(tiny_target, prepared):
    """What our producers store is read back by hs-connectors' own `get_sample` (the reader
    vLLM's hidden-states connector pairs with), and our batched reader reads theirs."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    from dspark.transport.master import MooncakeMaster
    from dspark.transport.stores import MooncakeStore
    from dspark.transport.wire import make_manifest

    capture = HiddenStateCapture(tiny_target, [0, 1], "bfloat16", topk=3)
    samples = [capture(s) for s in list(iter_samples(prepared))[:3]]
    capture.close()
    with MooncakeMaster.start() as master:
        ours = MooncakeStore(master.address, segment_bytes=64 << 20, buffer_bytes=16 << 20)
        theirs = MooncakeHiddenStatesStore(
            MooncakeStoreConfig(
                local_hostname="127.0.0.1",
                master_server_address=master.address,
                global_segment_size=64 << 20,
                local_buffer_size=16 << 20,
            )
        ).setup()
        manifests = [make_manifest(s, f"compat/{s.sample_id}") for s in samples]
        ours.put(manifests[0], samples[0].tensors())
        theirs.put_sample(manifests[1], samples[1].tensors())
        read_by_them = theirs.get_sample(manifests[0], timeout=5)
        read_by_us = ours.get_many(manifests[:2], timeout=5)
        missing = ours.get_many([manifests[2]], timeout=0.3)[0]
    for name, t in samples[0].tensors().items():
        assert torch.equal(read_by_them[name], t) and torch.equal(read_by_us[0][name], t)
    for name, t in samples[1].tensors().items():
        assert torch.equal(read_by_us[1][name], t)
    assert "status -704" in str(missing)


NETNS_SPEC = {
    "name": "netns-test",
    "kind": "netns",
    "nodes": [
        {"name": "infer-0", "role": "inference", "netns": "dspt-infer-0", "address": "10.78.0.10"},
        {"name": "infer-1", "role": "inference", "netns": "dspt-infer-1", "address": "10.78.0.11"},
        {"name": "train-0", "role": "training", "netns": "dspt-train-0", "address": "10.78.0.20"},
    ],
    "network": {"bridge": "dspt-br0"},
}


def _rx_bytes(ns: str) -> int:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True
    ).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


def test_stream_crosses_network_namespaces(tiny_target, tiny_target_dir, prepared, tmp_path):
    """Two producers in two inference namespaces, the consumer in the training one: every
    sample arrives exactly, and its bytes came in over the training node's interface."""
    from dspark.infra import netns
    from dspark.infra.spec import load_spec

    why = netns.missing()
    if why:
        skip_or_fail(f"network namespaces: {why}")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(json.dumps(NETNS_SPEC))  # JSON is YAML
    spec = load_spec(spec_path)
    netns.up(spec)
    try:
        before = _rx_bytes("dspt-train-0")
        sets = ["extract.mode=hybrid", f"provision.spec={spec_path}"]
        script = (
            "import sys; from pathlib import Path\n"
            "from tests.integration.test_stream import stream_params\n"
            "from dspark.extract.stage import extract_stage\n"
            f"m = extract_stage(stream_params(*{sets!r}),"
            f" target_dir=Path({str(tiny_target_dir)!r}),"
            f" shards_dir=Path({str(prepared)!r}), out_dir=Path({str(tmp_path / 'hidden')!r}),"
            " progress=False)\n"
            "print(m['bytes_received'])\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", "dspt-train-0", sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        received = int(out.stdout.strip().splitlines()[-1])
        assert _rx_bytes("dspt-train-0") - before > received  # payload + protocol overhead
        assert_exact(
            list(iter_hidden(tmp_path / "hidden")),
            expected_samples(tiny_target, prepared, [0, 1]),
        )
        # Outside the training node the stage refuses, naming the fix.
        with pytest.raises(Exception, match="the consumer belongs on node train-0"):
            extract_stage(
                stream_params(*sets),
                target_dir=tiny_target_dir,
                shards_dir=prepared,
                out_dir=tmp_path / "nowhere",
                progress=False,
            )
    finally:
        netns.down(spec)
    assert "dspt-train-0" not in netns.existing()


EXTRACT = """
import json, sys, time
from pathlib import Path
from dspark.config import Params
from dspark.extract.stage import extract_stage
job = json.loads(sys.argv[1])
def slowly(sample):
    print("sample", sample.sample_id, flush=True)
    time.sleep(0.5)
extract_stage(Params.model_validate(job["params"]), target_dir=Path(job["target"]),
        shards_dir=Path(job["shards"]), out_dir=Path(job["out"]), progress=False,
        on_sample=slowly)
"""


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(c) for t in tasks for c in (t / "children").read_text().split()]


def test_sigterm_to_extract_stops_its_producers(tiny_target_dir, prepared, tmp_path):
    """The producers sit in sessions of their own (a group signal must not take the stream from
    under a checkpointing trainer), so extract itself must stop them when it is terminated."""
    job = {
        "params": stream_params("extract.mode=hybrid").model_dump(mode="json"),
        "target": str(tiny_target_dir),
        "shards": str(prepared),
        "out": str(tmp_path / "hidden"),
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", EXTRACT, json.dumps(job)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().startswith("sample ")
        producers = [p for p in _children(proc.pid) if b"producer" in _cmdline(p)]
        assert len(producers) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30  # well before they would give up on their own (60 s)
    while any(map(_running, producers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, producers))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
