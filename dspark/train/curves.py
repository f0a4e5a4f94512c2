"""Learning curves fitted and extrapolated, so "converges slower" and "converges lower" can be
told apart from a run that stopped before the curves separated.

The fit is a saturating power law in optimizer steps,

    y(t) = a - b * t^(-c)          a: where the curve levels off, c: how fast it gets there

the shape held-out acceptance takes over training here (fast early gains, a long slow tail).
For each exponent on a grid, a and b are a linear least-squares fit; the exponent with the least
squared error wins. A small exponent means a curve still far from its level: its `a` is then a
long extrapolation, and `reliable` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_POINTS = 4  # evaluations after step 0 a fit needs
EXPONENTS = torch.logspace(-2, 1, 121, dtype=torch.float64)  # c from 0.01 to 10
# Below this exponent the level lies beyond any horizon a run here reaches (at c = 0.15,
# closing half the remaining gap takes 100 times the steps): a fitted `a` is not a measurement.
RELIABLE_EXPONENT = 0.15


@dataclass(frozen=True)
class PowerFit:
    a: float  # the level the curve approaches
    b: float
    c: float  # the exponent
    r2: float
    points: int
    last_step: int

    def at(self, step: float) -> float:
        return self.a - self.b * step ** (-self.c)

    def steps_to(self, value: float) -> float | None:
        """Steps until the fitted curve reaches `value` (None: it never does)."""
        if self.b <= 0 or value >= self.a:
            return None
        return (self.b / (self.a - value)) ** (1.0 / self.c)

    @property
    def reliable(self) -> bool:
        return self.c >= RELIABLE_EXPONENT and self.r2 >= 0.9

    def summary(self, reach: float | None = None) -> dict:
        """The fit and what it says: the level, the value at 2x and 10x the last step, and the
        steps to reach `reach` (another draft's final figure) where given."""
        out = {
            "level": round(self.a, 4),
            "exponent": round(self.c, 4),
            "r2": round(self.r2, 4),
            "points": self.points,
            "reliable": self.reliable,
            "last_step": self.last_step,
            "at_2x": round(self.at(2 * self.last_step), 4),
            "at_10x": round(self.at(10 * self.last_step), 4),
        }
        if reach is not None:
            steps = self.steps_to(reach)
            out["reach"] = reach
            out["steps_to_reach"] = None if steps is None else round(steps)
        return out


def fit_power(steps: list[float], values: list[float]) -> PowerFit | None:
    """Fit y = a - b t^-c to (step, value) pairs with step > 0; None with too few points."""
    pairs = [
        (float(t), float(y))
        for t, y in zip(steps, values, strict=True)
        if t and t > 0 and y is not None and math.isfinite(y)
    ]
    if len({t for t, _ in pairs}) < MIN_POINTS:
        return None
    t = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    total = float(((y - y.mean()) ** 2).sum())
    best = None
    for c in EXPONENTS:
        x = t ** (-c)
        design = torch.stack((torch.ones_like(x), -x), dim=1)  # y = a * 1 + b * (-x)
        coef = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
        sse = float(((design @ coef - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, float(coef[0]), float(coef[1]), float(c))
    sse, a, b, c = best
    r2 = 1.0 - sse / total if total > 0 else 1.0
    return PowerFit(a, b, c, r2, len(pairs), int(t.max()))


def fit_history(history: list[dict], key: str = "tau_decode") -> PowerFit | None:
    """Fit a draft's held-out history (DraftRun.history) on one of its figures."""
    return fit_power([h["step"] for h in history], [h.get(key) for h in history])
