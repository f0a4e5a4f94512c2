"""Progress that reaches whoever is watching: a tqdm bar in a terminal, whole lines in a log.

A stage under Prefect runs behind `dvc repro` with its output on a pipe, which the task reads
line by line into the flow run's logs (`tasks/proc.py`). A bar redrawn with carriage returns
there becomes a log line per redraw (ten a second) or, if buffered, nothing for minutes. So
off a terminal, `bar` writes a plain line, flushed, when work is done and at most once every
`LINE_INTERVAL_S` seconds, plus the final count; and `say` writes a line at once (through
`tqdm.write` in a terminal, so it does not tear a bar). Both write to stderr unless told.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import IO, Any

from tqdm import tqdm

LINE_INTERVAL_S = 10.0  # off a terminal: the most often a bar writes a line (its last: always)
LINE_FORMAT = (
    "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) [{elapsed}<{remaining}{postfix}]"
)
LINE_FORMAT_OPEN = "{desc}: {n_fmt} {unit} [{elapsed}{postfix}]"  # no total


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


# What tqdm writes to move between bars stacked on a terminal ("\x1b[A": cursor up).
_CURSOR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Lines:
    """A file for tqdm that turns its redraws ("\\r" + text + padding) into whole lines and
    drops the bare "\\r" and "\\n" it writes around them, the cursor moves between several
    bars, and a repeat of the last line (its close redraws the final count)."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.last = ""

    def write(self, s: str) -> None:
        text = _CURSOR.sub("", s).strip("\r\n").rstrip()
        if text and text != self.last:
            self.last = text
            self.stream.write(text + "\n")
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()


def bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    initial: int = 0,
    file: IO[str] | None = None,
    interval: float | None = None,
) -> tqdm:
    """A tqdm bar (`update`, `set_postfix_str`, `close`, a context manager, an iterator)
    that is a live bar on a terminal and a line every `interval` seconds elsewhere."""
    stream = file if file is not None else sys.stderr
    common: dict[str, Any] = {
        "iterable": iterable,
        "total": total,
        "desc": desc,
        "unit": unit,
        "initial": initial,
        "disable": not enabled,
    }
    if is_terminal(stream):
        return tqdm(file=stream, **common)
    every = LINE_INTERVAL_S if interval is None else interval
    known = total is not None or (iterable is not None and hasattr(iterable, "__len__"))
    return tqdm(
        file=_Lines(stream),
        mininterval=every,
        miniters=1,  # no dynamic miniters: its monitor thread would redraw on its own
        bar_format=LINE_FORMAT if known else LINE_FORMAT_OPEN,
        dynamic_ncols=False,
        ncols=None,
        **common,
    )


def say(msg: str, file: IO[str] | None = None) -> None:
    """One line now, flushed (a pipe's buffer would hold it for minutes), below any bar."""
    stream = file if file is not None else sys.stderr
    if is_terminal(stream):
        tqdm.write(msg, file=stream)
    else:
        stream.write(msg + "\n")
        stream.flush()
