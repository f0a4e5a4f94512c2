"""From decoding traces to the numbers the evaluation reports.

tau          tokens emitted per target verify step (accepted drafts + the target's own token),
             over all steps of all prompts; 1.0 for plain decoding
tau_ci95     its 95% bootstrap interval over the prompts (dspark.evaluate.stats); n prompts
pos_accept   per draft slot j: P(slot j accepted | slots before it accepted), over the steps
             that proposed slot j and reached it
distinct_2   distinct token bigrams / bigrams of an output, averaged over prompts; a looping
             output (which inflates tau) scores low
calibration  the DSpark confidence of each reached slot against whether it was accepted
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.decode.decoder import RowTrace, Timing
from dspark.evaluate.stats import tau_interval


def distinct_n(tokens: list[int], n: int = 2) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@dataclass
class Tally:
    """Running totals for one method on a set of prompts."""

    steps: int = 0
    emitted: int = 0
    tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    reached: list[int] = field(default_factory=list)  # per slot
    accepted: list[int] = field(default_factory=list)
    distinct: list[float] = field(default_factory=list)
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # per prompt: (emitted, steps)

    def add(self, trace: RowTrace, timing: Timing) -> None:
        self.outcomes.append((sum(trace.emitted), trace.steps))
        self.steps += trace.steps
        self.emitted += sum(trace.emitted)
        self.tokens += len(trace.tokens)
        self.prefill_s += timing.prefill_s
        self.draft_s += timing.draft_s
        self.verify_s += timing.verify_s
        self.distinct.append(distinct_n(trace.tokens))
        for a, p in zip(trace.accepted, trace.proposed, strict=True):
            for j in range(min(a + 1, p)):  # slots 0..a reached (a rejected, unless a == p)
                self._grow(j + 1)
                self.reached[j] += 1
                self.accepted[j] += j < a

    def merge(self, other: Tally) -> None:
        for name in ("steps", "emitted", "tokens", "prefill_s", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._grow(len(other.reached))
        for j, (r, a) in enumerate(zip(other.reached, other.accepted, strict=True)):
            self.reached[j] += r
            self.accepted[j] += a
        self.distinct.extend(other.distinct)
        self.outcomes.extend(other.outcomes)

    def _grow(self, n: int) -> None:
        while len(self.reached) < n:
            self.reached.append(0)
            self.accepted.append(0)

    @property
    def tau(self) -> float | None:
        """None when no verify step ran (every output ended on the prefill's token)."""
        return self.emitted / self.steps if self.steps else None

    def summary(self) -> dict:
        decode_s = self.draft_s + self.verify_s
        total_s = self.prefill_s + decode_s
        return {
            "n": len(self.outcomes),
            "tau": round(self.tau, 4) if self.steps else None,
            "tau_ci95": tau_interval(self.outcomes),
            "pos_accept": [
                round(a / r, 4) if r else None
                for a, r in zip(self.accepted, self.reached, strict=True)
            ],
            "tok_s": round(self.tokens / total_s, 2) if total_s else None,
            "decode_tok_s": round(self.tokens / decode_s, 2) if decode_s else None,
            "draft_share": round(self.draft_s / decode_s, 4) if decode_s else None,
            "distinct_2": round(sum(self.distinct) / len(self.distinct), 4)
            if self.distinct
            else None,
            "tokens": self.tokens,
            "verify_steps": self.steps,
        }


@dataclass
class Calibration:
    """Predicted confidence against observed acceptance, per slot and in bins."""

    bins: int = 10
    points: list[tuple[int, float, bool]] = field(default_factory=list)  # (slot, conf, accepted)

    def add(self, trace: RowTrace) -> None:
        if not trace.confidence:  # a draft without a confidence head
            return
        for conf, a, p in zip(trace.confidence, trace.accepted, trace.proposed, strict=True):
            for j in range(min(a + 1, p)):
                self.points.append((j, conf[j], j < a))

    def summary(self) -> dict:
        if not self.points:
            return {}
        slots = max(j for j, _, _ in self.points) + 1
        per_slot = []
        for j in range(slots):
            at = [(c, ok) for s, c, ok in self.points if s == j]
            per_slot.append(
                {
                    "slot": j,
                    "n": len(at),
                    "predicted": round(sum(c for c, _ in at) / len(at), 4) if at else None,
                    "observed": round(sum(ok for _, ok in at) / len(at), 4) if at else None,
                }
            )
        curve, ece = [], 0.0
        for b in range(self.bins):
            lo, hi = b / self.bins, (b + 1) / self.bins
            inside = [
                (c, ok)
                for _, c, ok in self.points
                if lo <= c < hi or (b == self.bins - 1 and c == 1.0)
            ]
            if not inside:
                continue
            pred = sum(c for c, _ in inside) / len(inside)
            obs = sum(ok for _, ok in inside) / len(inside)
            ece += len(inside) / len(self.points) * abs(pred - obs)
            curve.append(
                {
                    "bin": round(lo, 2),
                    "n": len(inside),
                    "predicted": round(pred, 4),
                    "observed": round(obs, 4),
                }
            )
        return {"per_slot": per_slot, "curve": curve, "ece": round(ece, 4), "n": len(self.points)}
