"""A benchmark cell measured in rounds: each round runs every mode once, the modes in a rotated
order, so no mode always runs first (a cold machine) or last (a drifted one). On this shared
2-core machine one mode's throughput moved up to 23% between rounds of the full profile. Two
modes measured in one round share that round's drift, and the median over rounds sets aside a
burst that hit one mode's run, so ratios are medians of same-round ratios, never ratios of
medians.
"""

from __future__ import annotations

import statistics

SUMMED = ("requests", "errors", "tokens", "steps", "draft_steps", "wall_s")
# A step's cost split (dspark.serve.measure.step_costs), averaged over all rounds' steps.
PER_STEP = (
    "draft_ms", "verify_ms", "accept_ms", "schedule_ms", "step_ms", "prefill_ms", "other_ms",
)  # fmt: skip
KEYS = ("mode", "concurrency", "workload")


def rotated(items: list, turn: int) -> list:
    """`items` starting at index turn (mod len): round i's order."""
    i = turn % len(items) if items else 0
    return items[i:] + items[:i]


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per-round cells (one list per round, a cell per mode) -> one cell per mode, in the first
    round's order, with the medians of its figures and `tok_s_rounds`, its throughput per round
    (round i at index i, for same-round ratios)."""
    by_mode: dict[str, list[dict]] = {}
    for group in rounds:
        for x in group:
            by_mode.setdefault(x["mode"], []).append(x)
    return [_merge(xs) for xs in by_mode.values()]


def _merge(xs: list[dict]) -> dict:
    out = dict(xs[0])
    steps = sum(x.get("steps") or 0 for x in xs)
    for key in xs[0]:
        vals = [x[key] for x in xs if x.get(key) is not None]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        if key in KEYS or not numbers:  # the first round's (a flag is the same every round)
            continue
        if key in SUMMED:
            out[key] = round(sum(vals), 3) if key == "wall_s" else sum(vals)
        elif key in PER_STEP:
            total = sum(x[key] * x["steps"] for x in xs if x.get(key) is not None)
            out[key] = round(total / steps, 2) if steps else None
        else:
            out[key] = statistics.median(vals) if vals else None
    if out.get("draft_ms") is not None and out.get("step_ms"):
        out["draft_share"] = round(out["draft_ms"] / out["step_ms"], 4)
    out["tok_s_rounds"] = [x["tok_s"] for x in xs]
    return out


def per_round(cell: dict | None) -> list[float] | None:
    """A merged cell's throughput per round (None without a cell, or if a round has none)."""
    series = None if cell is None else cell.get("tok_s_rounds")
    return None if not series or None in series else series


def round_max(*series: list[float] | None) -> list[float] | None:
    """Round by round, the best of several modes' throughputs (the modes present)."""
    present = [s for s in series if s]
    if not present:
        return None
    n = min(len(s) for s in present)
    return [max(s[i] for s in present) for i in range(n)]


def paired_ratio(mine: list[float] | None, theirs: list[float] | None) -> float | None:
    """The median over rounds of mine / theirs measured in the same round."""
    if not mine or not theirs:
        return None
    ratios = [a / b for a, b in zip(mine, theirs, strict=False) if b]
    return round(statistics.median(ratios), 3) if ratios else None


def spread(series: list[float] | None) -> float | None:
    """(max - min) / median over rounds: how far the machine moved one mode (None for one)."""
    if not series or len(series) < 2:
        return None
    return round((max(series) - min(series)) / statistics.median(series), 3)
