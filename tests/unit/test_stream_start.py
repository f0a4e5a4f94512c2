"""Starting the stream (dspark/extract/stage.py `open_stream`): a producer that fails to start
leaves none of those started before it running, and every producer's log file is the child's
alone. The transport's own parts (coordinators, the store) are replaced: what is checked is the
order of starting and stopping, with real child processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dspark.extract.stage as stage
from dspark.procs import alive


def test_a_failed_producer_start_stops_the_ones_already_running(
    smoke_params, tmp_path, monkeypatch
):
    started: list[subprocess.Popen] = []

    def start(slot, cfg, scratch):
        if started:
            raise OSError("producer 1: no such interpreter")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    monkeypatch.setattr(stage, "_num_layers", lambda target_dir: 4)
    monkeypatch.setattr(stage, "resolve_aux_layers", lambda layers, n: (1, 2))
    monkeypatch.setattr(stage, "_require_consumer_node", lambda spec: None)
    monkeypatch.setattr(stage, "_open_coordinators", lambda stack, *a, **k: [])
    monkeypatch.setattr(stage, "_open_store", lambda *a: (None, None))
    monkeypatch.setattr(stage, "place_producers", lambda spec, workers: ["slot0", "slot1"])
    monkeypatch.setattr(stage, "_producer_config", lambda *a: None)
    monkeypatch.setattr(stage, "_start_producer", start)
    with (
        pytest.raises(OSError, match="producer 1"),
        stage.open_stream(
            smoke_params, target_dir=tmp_path, shards_dir=tmp_path, sample_ids=[0, 1]
        ),
    ):
        pass
    assert len(started) == 1
    assert not alive(started[0].pid)
