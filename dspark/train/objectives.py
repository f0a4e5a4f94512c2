"""How each draft turns a batch into a loss: which positions it drafts from and what each slot
is measured against.

Both drafts draft from the same kind of position: an anchor p whose token x_p and successor
x_{p+1} are both response tokens (the anchor plays the bonus token the target just emitted, the
context is everything before it). Slot k then predicts x_{p+k+1}, judged against the target's own
distribution at position p+k. DSpark samples up to `max_anchors` such positions per sequence;
EAGLE-3's training-time test unrolls a chain from every one of them unless its own
`max_anchors` samples them too (its step 0 still runs over every position: later steps attend
to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.models.dspark import DSparkDraft
from dspark.models.eagle3 import Eagle3Draft
from dspark.train.batch import Batch
from dspark.train.losses import LossWeights, slot_losses


def anchor_candidates(batch: Batch) -> torch.Tensor:
    """[B, S] bool: x_p and x_{p+1} are response tokens (valid[t] says x_{t+1} is one)."""
    cand = batch.valid.clone()
    cand[:, 1:] &= batch.valid[:, :-1]
    cand[:, 0] = False
    return cand


def pick_anchors(
    cand: torch.Tensor, max_anchors: int | None, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` candidates per row, uniformly without replacement, sorted.

    -> positions [B, A] (padding 0) and a validity mask [B, A]. None keeps every candidate."""
    rows = []
    for row in cand:
        idx = row.nonzero()[:, 0]
        if max_anchors is not None and idx.numel() > max_anchors:
            keep = torch.randperm(idx.numel(), generator=gen)[:max_anchors]  # drawn on the host
            idx = idx[keep.to(idx.device)].sort().values
        rows.append(idx)
    width = max(1, max(r.numel() for r in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.int64, device=cand.device)
    ok = torch.zeros(len(rows), width, dtype=torch.bool, device=cand.device)
    for i, idx in enumerate(rows):
        anchors[i, : idx.numel()] = idx
        ok[i, : idx.numel()] = True
    return anchors, ok


def skip_draws(gen: torch.Generator, candidates: list[int], max_anchors: int | None) -> None:
    """Advance `gen` past the draws pick_anchors makes for rows with these candidate counts.

    A data-parallel rank replays the draws of the rows lower ranks hold of the same global
    batch, so it picks the anchors one process would have picked for its rows."""
    for n in candidates:
        if max_anchors is not None and n > max_anchors:
            torch.randperm(n, generator=gen)


@dataclass(frozen=True)
class Slots:
    """What each drafted slot is judged against, over the N valid anchors."""

    p_target: torch.Tensor  # [N, K, k] target probabilities (k = d when dense)
    p_ids: torch.Tensor | None  # [N, K, k] their draft indices; None: dense
    labels: torch.Tensor  # [N, K] the target's argmax (a draft index), -1 none
    valid: torch.Tensor  # [N, K] bool
    greedy: torch.Tensor | None = None  # [N, K] the target's greedy token (Batch.greedy)


def gather_slots(batch: Batch, anchors: torch.Tensor, ok: torch.Tensor, k: int) -> Slots:
    """Per slot (anchor a, slot j -> position p_a + j): target, labels and validity, flattened
    to [N, K, ...] over the valid anchors only."""
    s = batch.input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(k, device=anchors.device)  # [B, A, K]
    inside = pos < s
    pos = pos.clamp_max(s - 1)
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
    valid = batch.valid[rows, pos] & inside & ok[:, :, None]
    ids = None if batch.p_ids is None else batch.p_ids[rows, pos][ok]
    greedy = None if batch.greedy is None else batch.greedy[rows, pos][ok]
    return Slots(batch.p_target[rows, pos][ok], ids, batch.labels[rows, pos][ok], valid[ok], greedy)


def anchor_rows(anchors: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[N, 2] (row, position) of the valid anchors, in the order their blocks are flattened."""
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None].expand_as(anchors)
    return torch.stack((rows[ok], anchors[ok]), -1)


def measured(
    out: dict, model: torch.nn.Module, max_anchors: int | None, anchors, ok, logits
) -> dict:
    """In eval mode with every candidate an anchor, where each block sits (greedy decoding can
    then be walked over them: AcceptanceStats.tau_decode) and what each slot proposes (the
    copy-bias check reads slot 0's: train/diagnostics.py)."""
    if not model.training and max_anchors is None:
        out["at"] = anchor_rows(anchors, ok)
        out["proposed"] = logits.detach().argmax(-1)  # [N, K] draft indices
    return out


Total = Callable[[torch.Tensor], torch.Tensor]  # sums over the data-parallel ranks


@dataclass(frozen=True)
class DSparkObjective:
    weights: LossWeights
    max_anchors: int | None = 512
    total: Total | None = None  # data-parallel: normalize by the global batch (slot_losses)

    def __call__(self, model: DSparkDraft, batch: Batch, gen: torch.Generator | None) -> dict:
        anchors, ok = pick_anchors(anchor_candidates(batch), self.max_anchors, gen)
        logits, conf = model.forward_train(batch.input_ids, batch.aux, anchors, ok)
        t = gather_slots(batch, anchors, ok, model.cfg.draft_slots)
        out = slot_losses(
            logits,
            t.p_target,
            t.labels,
            t.valid,
            self.weights,
            conf,
            total=self.total,
            p_ids=t.p_ids,
            greedy=None if model.training else t.greedy,  # measured, never trained on
        )
        return measured(out, model, self.max_anchors, anchors, ok, logits)

    def skip(self, gen: torch.Generator, candidates: list[int]) -> None:
        skip_draws(gen, candidates, self.max_anchors)


@dataclass(frozen=True)
class Eagle3Objective:
    weights: LossWeights
    max_anchors: int | None = None  # chains per sequence; None unrolls from every candidate
    total: Total | None = None

    def __call__(self, model: Eagle3Draft, batch: Batch, gen: torch.Generator | None) -> dict:
        chains, ok = pick_anchors(anchor_candidates(batch), self.max_anchors, gen)
        logits = model.forward_ttt(batch.input_ids, batch.aux, chains, ok)  # [N, K, d]
        t = gather_slots(batch, chains, ok, model.cfg.ttt_steps)
        out = slot_losses(
            logits,
            t.p_target,
            t.labels,
            t.valid,
            self.weights,
            total=self.total,
            p_ids=t.p_ids,
            greedy=None if model.training else t.greedy,
        )
        return measured(out, model, self.max_anchors, chains, ok, logits)

    def skip(self, gen: torch.Generator, candidates: list[int]) -> None:
        skip_draws(gen, candidates, self.max_anchors)
