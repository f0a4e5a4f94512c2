"""The cost model: how many of its drafted tokens each request sends to the target this step
(vLLM PR 47808 describes the scheme for a confidence head; here every speculative mode uses it).

Slot j of request r survives verification only if slots 0..j all do, so its expected worth is the
survival s[r, j] = prod_{i<=j} p[r, i] of the per-slot conditional acceptance p: DSpark's
confidences calibrated by what verification measured, or, for a draft without a confidence head,
the acceptance measured online per slot (dspark.decode.acceptance). Verifying n tokens in a step
costs cost(n) milliseconds (profiled at start), and a drafting step also pays the draft's own
measured cost. Every request verifies its anchor and gains its bonus token regardless, so with B
requests and T extra draft slots a step is expected to emit B + (the T largest survivals) tokens
in overhead + cost(B + T). The best T maximizes that ratio; since each request's survivals only
fall along its block, the T largest always form a prefix per request: a request's block stops
where the rest is expected to be rejected.

Two clocks, as in vLLM: the step's budget T comes from a smoothed (EMA) survival curve, so a few
noisy confidences do not swing the batch size; which requests get the budget comes from this
step's own survivals.

Shape glossary: B requests, k drafted slots per request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from dspark.config import serving_modes
from dspark.decode.acceptance import AcceptanceMeter


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


def cost_modelled(mode: str, cost_model: bool) -> bool:
    """Whether a serving mode's engine profiles the verify cost and plans by it: dspark_adaptive
    is the cost model on DSpark's head, always; dspark_fixed is the hand-fixed k the others are
    measured against, never; every other mode of the engine that drafts, when
    `serve.cost_model` is on."""
    if mode in ("dspark_adaptive", "dspark_fixed"):
        return mode == "dspark_adaptive"
    return cost_model and mode in serving_modes() and mode != "none"


@dataclass
class AdaptiveScheduler:
    cost: VerifyCost
    smoothing: float = 0.8  # weight of the past in the EMA of the mean survival curve
    decay: float = 0.98  # weight of the past in the measured acceptance, per verifying step
    overhead_ms: float = 0.0  # a drafting step's cost besides verification (the engine's)
    probe_every: int = 8  # where drafting does not pay, draft again after this many steps,
    max_probe_every: int = 64  # doubling up to this while it keeps not paying
    curve: torch.Tensor | None = field(default=None, init=False)  # [k]
    pays: bool = field(default=True, init=False)  # did drafting beat a plain step, last time?
    meter: AcceptanceMeter | None = field(default=None, init=False)
    probes: int = field(default=0, init=False)  # steps that verified a block only to measure
    _seen: torch.Tensor | None = field(default=None, init=False)  # [k] bool: curve has slot j
    _interval: int = field(default=1, init=False)
    _skipped: int = field(default=0, init=False)
    _probe_turn: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)  # engine steps since the last plan

    def start(self, rows: int, k: int) -> None:
        """An engine of `rows` rows whose proposer drafts up to k tokens: a fresh meter."""
        self.meter = AcceptanceMeter(rows, k, self.decay)

    def admit(self, row: int) -> None:
        self.meter.reset(row)

    def state(self) -> dict:
        """What the next decisions rest on (the server's stats show it)."""
        return {
            "pays": self.pays,
            "overhead_ms": round(self.overhead_ms, 3),
            "probe_interval": 1 if self.pays else self._interval,
            "probes": self.probes,
            "curve": None if self.curve is None else [round(x, 4) for x in self.curve.tolist()],
            "acceptance": None if self.meter is None else self.meter.state(),
        }

    def wants_draft(self) -> bool:
        """Whether to draft this step. When a drafting step (its drafting cost included) is
        expected to emit fewer tokens per millisecond than a plain step, drafting is wasted
        except to measure: it happens again after `probe_every` steps, then after twice as many
        while it keeps not paying, up to `max_probe_every`. So where drafts do not pay the mode
        costs little more than the target alone, and it finds out within a few dozen steps
        when they start to."""
        self._steps += 1
        if self.pays:
            return True
        self._skipped += 1
        if self._skipped >= self._interval:
            self._skipped = 0
            return True
        return False

    def decide(
        self, rows: torch.Tensor, k_row: torch.Tensor, conf: torch.Tensor | None
    ) -> torch.Tensor:
        """The engine's plan: rows [B] pool indices, k_row [B] drafts each proposed, conf
        [B, w] the head's confidences or None -> [B] drafts each verifies. A head's confidences
        are calibrated by the meter; without one, each row's measured rates stand in."""
        k = self.meter.k  # the curve's width, whatever this proposal's
        if conf is not None:
            p = self.meter.calibrate(conf[:, :k])
            p = torch.cat((p, p.new_zeros(p.shape[0], k - p.shape[1])), dim=1)  # [B, k]
        else:
            p = self.meter.rates(rows, k)
        return self.plan(p, k_row)

    def observe(
        self,
        rows: torch.Tensor,
        proposed: torch.Tensor,
        accepted: torch.Tensor,
        conf: torch.Tensor | None,
    ) -> None:
        """A drafting step's verdicts (rows [B], proposed [B], accepted [B], conf [B, w])."""
        self.meter.observe(rows, proposed, accepted, conf)

    def plan(self, conf: torch.Tensor, k_row: torch.Tensor | None = None) -> torch.Tensor:
        """conf [B, k] P(slot accepted | slots before) per request, k_row [B] how many slots
        each proposed (default all k) -> [B] drafted tokens to verify per request. Where drafting
        is not expected to pay, one request's whole block (a different request each time) is
        verified all the same, so the measured acceptance and the calibration keep learning."""
        conf = conf.double()  # calibrated confidences and measured rates alike
        b, k = conf.shape
        k_row = torch.full((b,), k) if k_row is None else k_row
        have = torch.arange(k) < k_row[:, None]  # [B, k] slots proposed
        surv = survival(conf) * have
        n = have.sum(0)  # [k] requests that proposed slot j
        # The curve is the mean survival of slot j where it was proposed: a request that found
        # nothing to propose (prompt lookup) does not pull down the others' worth.
        mean = surv.sum(0) / n.clamp_min(1)
        if self.curve is None:
            self.curve, self._seen = mean, torch.zeros(k, dtype=torch.bool)
        # The curve's memory is in engine steps, not plans: after drafting was off for a while
        # the past weighs as little as that many steps of smoothing leave it, so a curve from
        # before the calibration moved does not hold drafting off.
        gap, self._steps = max(self._steps, 1), 0
        aged = self.smoothing ** (gap - 1)
        # The budget reads the curve as it stood before this step (aged by the steps skipped);
        # slots new to it, this step's.
        curve = torch.where(self._seen, aged * self.curve + (1 - aged) * mean, mean)
        past = self.smoothing**gap
        ema = past * self.curve + (1 - past) * mean
        self.curve = torch.where(n > 0, torch.where(self._seen, ema, mean), self.curve)
        self._seen = self._seen | (n > 0)
        smooth = curve.expand_as(surv) * have
        budget = best_budget(smooth, self.cost, self.overhead_ms)
        gain = float(smooth.flatten().sort(descending=True).values[:budget].sum())
        drafting = (b + gain) / (self.overhead_ms + self.cost(b + budget))
        self.pays = drafting > b / self.cost(b)
        if self.pays:
            self._interval = 1
            return allocate(surv, budget)
        self._interval = min(max(2 * self._interval, self.probe_every), self.max_probe_every)
        return self._probe(k_row)

    def _probe(self, k_row: torch.Tensor) -> torch.Tensor:
        """[B] one proposing request's whole block, the next such request each probe."""
        lengths = torch.zeros_like(k_row)
        proposing = torch.nonzero(k_row > 0).flatten()
        if len(proposing):
            i = int(proposing[self._probe_turn % len(proposing)])
            lengths[i] = k_row[i]
            self._probe_turn += 1
            self.probes += 1
        return lengths
