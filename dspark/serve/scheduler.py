"""Confidence-scheduled verification: how many of its drafted tokens each request sends to the
target this step (DSpark's `dspark_adaptive` mode; vLLM PR 47808 describes the scheme).

Slot j of request r survives verification only if slots 0..j all do, so its expected worth is the
survival s[r, j] = prod_{i<=j} c[r, i] of the DSpark confidences c. Verifying n tokens in a step
costs cost(n) milliseconds (profiled at start). Every request verifies its anchor and gains its
bonus token regardless, so with B requests and T extra draft slots a step is expected to emit
B + (the T largest survivals) tokens in cost(B + T). The best T maximizes that ratio; since each
request's survivals only fall along its block, the T largest always form a prefix per request.

Two clocks, as in vLLM: the step's budget T comes from a smoothed (EMA) survival curve, so a few
noisy confidences do not swing the batch size; which requests get the budget comes from this
step's own confidences.

Shape glossary: B requests, k drafted slots per request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


def survival(conf: torch.Tensor) -> torch.Tensor:
    """[B, k] P(slot accepted | slots before accepted) -> [B, k] P(slots 0..j all accepted)."""
    return conf.clamp(0.0, 1.0).cumprod(dim=-1)


@dataclass(frozen=True)
class VerifyCost:
    """Measured cost of a verify step by the number of tokens it verifies (anchors included)."""

    tokens: tuple[int, ...]  # increasing
    ms: tuple[float, ...]

    def __post_init__(self):
        if len(self.tokens) != len(self.ms) or len(self.tokens) < 2:
            raise ValueError("VerifyCost: need at least two (tokens, ms) points of equal count")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError("VerifyCost: token counts must increase")

    def __call__(self, n: int) -> float:
        """Piecewise linear in n, extended past both ends by the nearest segment."""
        i = min(max(bisect.bisect_right(self.tokens, n) - 1, 0), len(self.tokens) - 2)
        (x0, x1), (y0, y1) = self.tokens[i : i + 2], self.ms[i : i + 2]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def best_budget(surv: torch.Tensor, cost: VerifyCost, overhead_ms: float = 0.0) -> int:
    """The number of draft slots T (over the whole batch) that maximizes expected emitted tokens
    per millisecond, given survivals [B, k]; a step also pays `overhead_ms` (drafting) whatever
    T is."""
    b = surv.shape[0]
    if b == 0:
        return 0
    gains = torch.cat((surv.new_zeros(1), surv.flatten().sort(descending=True).values.cumsum(0)))
    rate = [(b + float(gains[t])) / (overhead_ms + cost(b + t)) for t in range(len(gains))]
    return max(range(len(rate)), key=rate.__getitem__)


def allocate(surv: torch.Tensor, budget: int) -> torch.Tensor:
    """Split `budget` slots over requests by this step's survivals -> [B] prefix lengths.

    The `budget` largest survivals win; ties go to the earlier slot, then the earlier request,
    so each request's share is a prefix of its block."""
    b, k = surv.shape
    budget = max(0, min(budget, b * k))
    slot = torch.arange(k).expand(b, k)
    row = torch.arange(b)[:, None].expand(b, k)
    order = sorted(
        zip(surv.flatten().tolist(), slot.flatten().tolist(), row.flatten().tolist(), strict=True),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    lengths = torch.zeros(b, dtype=torch.long)
    for _, _, r in order[:budget]:
        lengths[r] += 1
    return lengths


@dataclass
class AdaptiveScheduler:
    cost: VerifyCost
    smoothing: float = 0.8  # weight of the past in the EMA of the mean survival curve
    overhead_ms: float = 0.0  # a step's cost besides verification (the engine measures it)
    probe_every: int = 8  # where drafting does not pay, draft again after this many steps,
    max_probe_every: int = 64  # doubling up to this while it keeps not paying
    curve: torch.Tensor | None = field(default=None, init=False)  # [k]
    pays: bool = field(default=True, init=False)  # did drafting beat a plain step, last time?
    _interval: int = field(default=1, init=False)
    _skipped: int = field(default=0, init=False)

    def state(self) -> dict:
        """What the next decisions rest on (the server's stats show it)."""
        return {
            "pays": self.pays,
            "overhead_ms": round(self.overhead_ms, 3),
            "probe_interval": 1 if self.pays else self._interval,
            "curve": None if self.curve is None else [round(x, 4) for x in self.curve.tolist()],
        }

    def wants_draft(self) -> bool:
        """Whether to draft this step. When a drafting step (its drafting cost included) is
        expected to emit fewer tokens per millisecond than a plain step, drafting is wasted
        except to refresh the survival curve: it happens again after `probe_every` steps, then
        after twice as many while it keeps not paying, up to `max_probe_every`. So where drafts
        do not pay the adaptive mode costs little more than the target alone, and it finds
        out within a few dozen steps when they start to."""
        if self.pays:
            return True
        self._skipped += 1
        if self._skipped >= self._interval:
            self._skipped = 0
            return True
        return False

    def plan(self, conf: torch.Tensor) -> torch.Tensor:
        """conf [B, k] this step's confidences -> [B] drafted tokens to verify per request."""
        surv = survival(conf)
        mean = surv.mean(dim=0)
        # The budget reads the curve as it stood before this step; the first step has only this.
        curve = mean if self.curve is None else self.curve
        self.curve = (
            mean
            if self.curve is None
            else self.smoothing * self.curve + (1 - self.smoothing) * mean
        )
        smooth = curve.expand_as(surv)
        budget = best_budget(smooth, self.cost, self.overhead_ms)
        b = surv.shape[0]
        gain = float(smooth.flatten().sort(descending=True).values[:budget].sum())
        drafting = (b + gain) / (self.overhead_ms + self.cost(b + budget))
        self.pays = drafting > b / self.cost(b)
        if self.pays:
            self._interval = 1
        else:
            self._interval = min(max(2 * self._interval, self.probe_every), self.max_probe_every)
        return allocate(surv, budget)
