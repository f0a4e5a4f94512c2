"""Stopping a long stage at a point it can resume from.

SIGTERM (a cancelled flow run, `kill`) or SIGINT (Ctrl-C) only raises a flag; the stage looks
at it where its state is whole (the trainer: between steps), writes its checkpoint and raises
`Stopped`. A second signal is not patient: it gets the default action at once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """A stage stopped on request after saving what resumes it. `code` is the exit status a
    shell gives a process the signal ended (128 + its number)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.code = 128 + signum


class StopRequest:
    """Set by the first SIGTERM or SIGINT while `on_signals` is active."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def set(self, signum: int = signal.SIGTERM) -> None:
        if self.signum is None:
            self.signum = signum


@contextmanager
def on_signals() -> Iterator[StopRequest]:
    """A StopRequest that SIGTERM and SIGINT set, for the duration. Off the main thread
    (where Python cannot take signals) it is never set by one; nor by a signal the process
    ignores."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def first(signum, _frame):
        if request:  # the second one: act as if we had never asked
            for sig, handler in previous.items():
                signal.signal(sig, handler or signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        request.set(signum)

    # A signal the process was started ignoring (SIGINT under `cmd &` in a script) stays so.
    previous: dict = {}
    for sig in SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            previous[sig] = signal.signal(sig, first)
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler or signal.SIG_DFL)


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """For stages with nothing to save mid-way: SIGTERM unwinds like Ctrl-C (SystemExit with
    128 + 15), so their `with` blocks stop the processes they started and free their ports."""

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
