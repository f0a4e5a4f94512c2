"""Per-slot acceptance of drafts, measured from verification results (the serving engine's
cost model reads it: dspark.serve.scheduler).

Slot j of a row's proposal is a trial when the row sent more than j drafts to verification and
the drafts before j were accepted, and a hit when slot j was accepted too. Hits over trials
estimate p_j = P(slot j accepted | slots before it accepted), the conditional acceptance a
block's survival prod_{i<=j} p_i is built from. Slots past the first rejection are no trials:
nothing was learned about them. (`hybrid`, dspark.decode.hybrid, measures its two sources per
request the same way, judging each against the tokens a step emitted.)

Without a confidence head, p_j is hits over trials with a prior of one hit in two trials.

A head predicts p_j itself, but a head can be biased: run 6's DSpark head was low enough that
the adaptive mode never drafted. Its calibrated confidence is its own confidence scaled by the
measured ratio of hits to the confidence it predicted at the same trials, per slot. The prior is
the head itself (2 pseudo-trials at the head's mean confidence there), not a fixed count, so a
head biased far low is corrected after a few trials rather than a few dozen.

The counts are pooled over every row of an engine with a decay, so they follow the text as it
drifts, and kept per row (per request) as well, drawn toward the pooled rate.

Shape glossary: R rows in the engine's pool, n rows observed in a step, k slots (the proposer's
most drafts per step), w the width of one proposal (w <= k).
"""

from __future__ import annotations

import torch

PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # a rate of 1/2 until trials say otherwise
SHRINK = 2.0  # pseudo-trials drawing a request's own rate toward the pooled rate


def trials(proposed: torch.Tensor, accepted: torch.Tensor, k: int):
    """proposed [n] drafts verified, accepted [n] of them -> (tried [n, k], hit [n, k]) as 0/1
    floats: slot j is a trial when j < proposed and j <= accepted, a hit when j < accepted."""
    j = torch.arange(k)
    tried = (j < proposed[:, None]) & (j <= accepted[:, None])
    hit = j < accepted[:, None]
    return tried.double(), hit.double()


class AcceptanceMeter:
    """Per-slot trials, hits and confidence at the trials: pooled over every row (each step
    weighs the counts before it by `decay`, so about 1 / (1 - decay) steps of history count)
    and per row since the row's request started (no decay: a request is short)."""

    def __init__(self, rows: int, k: int, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: {decay} is not in [0, 1)")
        self.k, self.decay = k, decay
        self.tried = torch.zeros(k, dtype=torch.float64)  # [k] pooled, decayed
        self.hit = torch.zeros(k, dtype=torch.float64)
        self.conf = torch.zeros(k, dtype=torch.float64)  # confidence summed over trials
        self.row_tried = torch.zeros(rows, k, dtype=torch.float64)  # [R, k]
        self.row_hit = torch.zeros(rows, k, dtype=torch.float64)

    def reset(self, row: int) -> None:
        """Row `row` starts a new request: what its last one measured is its own no more."""
        self.row_tried[row] = 0.0
        self.row_hit[row] = 0.0

    def observe(
        self,
        rows: torch.Tensor,  # [n] pool indices
        proposed: torch.Tensor,  # [n] drafts each verified
        accepted: torch.Tensor,  # [n] of them accepted
        conf: torch.Tensor | None = None,  # [n, w] the head's confidences, when it has them
    ) -> None:
        tried, hit = trials(proposed, accepted, self.k)  # [n, k]
        self.tried.mul_(self.decay).add_(tried.sum(0))
        self.hit.mul_(self.decay).add_(hit.sum(0))
        self.conf.mul_(self.decay)
        if conf is not None:
            w = conf.shape[1]
            self.conf[:w] += (conf.double() * tried[:, :w]).sum(0)
        self.row_tried[rows] += tried
        self.row_hit[rows] += hit

    def pooled(self) -> torch.Tensor:
        """-> [k] the pooled conditional acceptance per slot."""
        return (self.hit + PRIOR_HITS) / (self.tried + PRIOR_TRIALS)

    def rates(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """rows [n] -> [n, width] each row's own rate, drawn toward the pooled one by SHRINK
        pseudo-trials (a request with few trials reads mostly as the pool does)."""
        pooled = self.pooled()[:width]
        hit, tried = self.row_hit[rows, :width], self.row_tried[rows, :width]
        return (hit + SHRINK * pooled) / (tried + SHRINK)

    def ratio(self) -> torch.Tensor:
        """-> [k] measured hits over predicted confidence per slot (1: the head is right, and
        where nothing was tried), the prior being PRIOR_TRIALS trials at the head's mean."""
        mean = self.conf / self.tried.clamp_min(1e-9)  # the head's mean confidence at trials
        prior = PRIOR_TRIALS * mean
        ratio = (self.hit + prior) / (self.conf + prior).clamp_min(1e-12)
        return torch.where(self.conf > 0, ratio, torch.ones_like(ratio))

    def calibrate(self, conf: torch.Tensor) -> torch.Tensor:
        """conf [n, w] a head's confidences -> [n, w] scaled by the ratio, clipped to [0, 1]."""
        w = conf.shape[1]
        return (conf.double() * self.ratio()[:w]).clamp(0.0, 1.0)

    def state(self) -> dict:
        """The pooled figures (the server's stats show them): decayed trials, the measured
        rate per slot and, for a head, its calibration ratio per slot."""
        out = {
            "trials": [round(x, 2) for x in self.tried.tolist()],
            "rate": [round(x, 4) for x in self.pooled().tolist()],
        }
        if bool(self.conf.any()):
            out["calibration"] = [round(x, 4) for x in self.ratio().tolist()]
        return out
