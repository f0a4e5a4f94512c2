"""Progress off a terminal is whole lines (what a pipe into Prefect's logs can carry), at most
one per interval plus the last; on a terminal it is tqdm's bar."""

import io

from dspark import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_unit_is_a_line():
    out = io.StringIO()
    bar = progress.bar(total=3, desc="evaluate", unit="prompts", file=out, interval=0.0)
    for cat in ("qa", "rag", "writing"):
        bar.set_postfix_str(cat, refresh=False)
        bar.update(1)
    bar.close()
    progress.say("benchmark: c=1 none 12 tok/s", file=out)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split(" [")[0] for ln in lines] == [
        "evaluate: 0/3 prompts (0%)",
        "evaluate: 1/3 prompts (33%)",
        "evaluate: 2/3 prompts (67%)",
        "evaluate: 3/3 prompts (100%)",  # once: the close repeats nothing
        "benchmark: c=1 none 12 tok/s",
    ]
    assert lines[3].endswith(", writing]")


def test_lines_are_rate_limited_but_the_last_count_is_written():
    out = io.StringIO()
    for _ in progress.bar(range(500), desc="sweep", unit="decodes", file=out, interval=3600):
        pass
    assert out.getvalue().splitlines() == [
        "sweep: 0/500 decodes (0%) [00:00<?]",
        out.getvalue().splitlines()[-1],
    ]
    assert out.getvalue().splitlines()[-1].startswith("sweep: 500/500 decodes (100%)")


def test_without_a_total_the_count_is_written():
    out = io.StringIO()
    with progress.bar(desc="cells", unit="cells", file=out, interval=0.0) as bar:
        bar.update(2)
    assert out.getvalue().splitlines()[-1].startswith("cells: 2 cells [")


def test_disabled_says_nothing():
    out = io.StringIO()
    with progress.bar(total=2, desc="x", file=out, enabled=False) as bar:
        bar.update(2)
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_redrawn_bar():
    out = Terminal()
    with progress.bar(total=2, desc="evaluate", unit="prompts", file=out) as bar:
        bar.update(2)
    assert "\r" in out.getvalue() and "2/2" in out.getvalue()


def test_several_bars_off_a_terminal_write_no_cursor_moves():
    out = io.StringIO()
    bars = [
        progress.bar(total=2, desc=f"evaluate: {m}", unit="prompts", file=out, interval=0)
        for m in "ab"
    ]
    for b in bars:
        b.update(2)
        b.close()
    text = out.getvalue()
    assert "\x1b" not in text, repr(text)
    assert "evaluate: a: 2/2 prompts (100%)" in text and "evaluate: b: 2/2 prompts (100%)" in text
