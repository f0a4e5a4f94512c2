"""How sure the acceptance figures are: bootstrap intervals over prompts.

tau for a set of prompts is a ratio, emitted tokens over verify steps, pooled over the prompts
(`summary.Tally`). The prompts are the sampling unit: a resample draws the set's prompts with
replacement and recomputes the pooled ratio, so a long prompt weighs as much as it did in the
estimate. A mean over categories resamples within each category (the categories are fixed, the
prompts in them are the draw). Two methods are compared on the same prompts, so their ratio is
bootstrapped paired: one draw of prompt indices serves both.

Shapes: R resamples, n prompts in a category.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Outcomes = Sequence[tuple[int, int]]  # per prompt: (tokens emitted, verify steps)
LEVEL = 0.95


def _draws(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, n, size=(resamples, n))  # [R, n] prompt indices


def _pooled(outcomes: Outcomes, idx: np.ndarray) -> np.ndarray:
    """[R] pooled tau of each resample; NaN where a resample holds no verify step."""
    arr = np.asarray(outcomes, dtype=np.float64).reshape(-1, 2)
    emitted, steps = arr[idx, 0].sum(axis=1), arr[idx, 1].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(steps > 0, emitted / steps, np.nan)


def pooled_tau(outcomes: Outcomes) -> float | None:
    """Tokens emitted over verify steps, pooled over the prompts (None with no step)."""
    tau = float(_pooled(outcomes, np.arange(len(outcomes))[None, :])[0]) if outcomes else np.nan
    return tau if np.isfinite(tau) else None


def _interval(values: np.ndarray, level: float) -> list[float] | None:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return [round(float(lo), 4), round(float(hi), 4)]


def tau_interval(
    outcomes: Outcomes, *, resamples: int = 2000, seed: int = 0, level: float = LEVEL
) -> list[float] | None:
    """The percentile bootstrap interval of one set's pooled tau (None with no prompts)."""
    if not outcomes:
        return None
    rng = np.random.default_rng(seed)
    return _interval(_pooled(outcomes, _draws(len(outcomes), resamples, rng)), level)


def _category_means(
    by_method: Mapping[str, Mapping[str, Outcomes]], resamples: int, seed: int
) -> dict[str, np.ndarray]:
    """[R] resampled mean over categories of tau, per method, every method on the same draws."""
    methods = list(by_method)
    cats = sorted(set.intersection(*(set(by_method[m]) for m in methods)))
    rng = np.random.default_rng(seed)
    per_cat: dict[str, list[np.ndarray]] = {m: [] for m in methods}
    for cat in cats:
        n = len(by_method[methods[0]][cat])
        if any(len(by_method[m][cat]) != n for m in methods):
            raise ValueError(f"{cat}: the methods were decoded on different prompt counts")
        if n == 0:
            continue
        idx = _draws(n, resamples, rng)  # one draw for every method: paired
        for m in methods:
            per_cat[m].append(_pooled(by_method[m][cat], idx))
    with np.errstate(invalid="ignore"):
        return {
            m: np.nanmean(np.stack(v), axis=0) if v else np.full(resamples, np.nan)
            for m, v in per_cat.items()
        }


def mean_tau_interval(
    by_category: Mapping[str, Outcomes],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = LEVEL,
) -> list[float] | None:
    """The interval of a method's mean over categories of tau."""
    means = _category_means({"m": by_category}, resamples, seed)["m"]
    return _interval(means, level)


def paired_ratio(
    a: Mapping[str, Outcomes],
    b: Mapping[str, Outcomes],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = LEVEL,
) -> dict | None:
    """Mean tau of `a` over mean tau of `b` on the same prompts of the same categories, with its
    paired bootstrap interval. Both map category -> per-prompt outcomes in the same order."""
    cats = sorted(set(a) & set(b))
    if not cats:
        return None
    full = {
        m: [np.nan if (t := pooled_tau(o[c])) is None else t for c in cats if len(o[c])]
        for m, o in (("a", a), ("b", b))
    }
    with np.errstate(invalid="ignore"):
        mean_a, mean_b = np.nanmean(full["a"]), np.nanmean(full["b"])
    if not (np.isfinite(mean_a) and np.isfinite(mean_b)) or mean_b == 0:
        return None
    boot = _category_means({"a": a, "b": b}, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = boot["a"] / boot["b"]
    return {"ratio": round(float(mean_a / mean_b), 4), "ci95": _interval(ratios, level)}


def verdict(interval: list[float] | None, goal: float) -> str:
    """Where an interval stands against a goal: 'met' (all of it at or above), 'missed' (all
    below) or 'straddles'."""
    if interval is None:
        return "unknown"
    lo, hi = interval
    if lo >= goal:
        return "met"
    if hi < goal:
        return "missed"
    return "straddles"
