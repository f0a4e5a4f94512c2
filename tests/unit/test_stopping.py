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
