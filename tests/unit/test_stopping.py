"""A stop request: the first SIGTERM or SIGINT only raises the flag; a second one acts at once."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from dspark.stopping import Stopped, on_signals


@pytest.fixture
def terminal_sigint():
    """SIGINT as a terminal's process has it (under `cmd &` in a script it is ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_only_asks_and_the_handlers_come_back(sig, terminal_sigint):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with on_signals() as request:
        assert not request
        os.kill(os.getpid(), sig)
        assert request and request.signum == sig  # and this process is still here
    assert {s: signal.getsignal(s) for s in before} == before
    assert Stopped("x", request.signum).code == 128 + sig


SECOND = """
import os, signal, sys
from dspark.stopping import on_signals
sig = getattr(signal, sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as if started from a terminal
with on_signals() as request:
    os.kill(os.getpid(), sig)
    print("asked", request.signum == sig, flush=True)
    os.kill(os.getpid(), sig)
    print("still here", flush=True)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_second_signal_gets_the_default_action(name):
    out = subprocess.run(
        [sys.executable, "-c", SECOND, name], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.splitlines() == ["asked True"]
    # SIGINT's default is Python's KeyboardInterrupt, which ends the process by SIGINT too.
    assert out.returncode == -getattr(signal, name)


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def worker():
        with on_signals() as request:
            seen.append((bool(request), signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(False, before)]


def test_a_signal_the_process_ignores_stays_ignored():
    """`cmd &` in a script starts cmd with SIGINT ignored: Ctrl-C is not meant for it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with on_signals() as request:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not request
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# The stage: a stop request, a second of saving, exit 128 + the signal. A second signal
# would end it at once, without "saved".
STAGE = """
import sys, time
from pathlib import Path
from dspark.stopping import on_signals
with on_signals() as request:
    print("ready", flush=True)
    while not request:
        time.sleep(0.01)
    time.sleep(1.0)
Path(sys.argv[1]).write_text("saved")
sys.exit(128 + request.signum)
"""
# `dspark` moving onto a node's namespace, with the namespace left out.
REEXEC = """
import signal, sys
from types import SimpleNamespace
from dspark.infra import netns
signal.signal(signal.SIGINT, signal.default_int_handler)  # as if started from a terminal
netns.namespace_cmd = lambda _ns, _argv: [sys.executable, "-c", sys.argv[1], sys.argv[2]]
sys.exit(netns.reexec_on(SimpleNamespace(netns="node"), []))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stage_moved_into_a_namespace_gets_the_signal_once_and_time_to_save(sig, tmp_path):
    """Ctrl-C or a cancelled flow signals the whole group of the `dspark` that re-ran itself
    inside a namespace: the stage there must see it once (a second ends it unsaved) and be
    waited for."""
    saved = tmp_path / "saved"
    proc = subprocess.Popen(
        [sys.executable, "-c", REEXEC, STAGE, str(saved)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert saved.read_text() == "saved"
