"""Per-slot losses and the simulated acceptance both drafts are trained and judged by.

A "slot" is one drafted position: DSpark slot k of an anchor's block, or EAGLE-3 step k of a
position's unrolled training-time test. Everything here works on the draft vocabulary; the
target's probability mass outside it counts as mass the draft can never match.

Shape glossary: N anchors (or positions), K slots, d draft vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1  # cross-entropy on the target's argmax over the draft vocabulary (as `ce`
    # in speculators, which also sees only the draft vocabulary)
    tv: float = 0.9  # total variation to the target's distribution
    kl: float = 0.0  # forward KL to the target's distribution (EAGLE-3's loss)
    gamma: float | None = 4.0  # slot k weighs exp(-k / gamma); None: no decay
    decay: float | None = None  # slot k weighs decay**k (EAGLE-3's form); exclusive with gamma
    confidence: float = 0.0

    def slot_weights(self, k: int) -> torch.Tensor:
        idx = torch.arange(k, dtype=torch.float32)
        if self.decay is not None:
            return self.decay**idx
        if self.gamma is not None:
            return torch.exp(-idx / self.gamma)
        return torch.ones(k)


def supervised_prefix(valid: torch.Tensor) -> torch.Tensor:
    """[N, K] bool: slot k counts only while every slot up to k is valid."""
    return valid.to(torch.int64).cumprod(dim=-1).to(torch.bool)


def acceptance(p_draft_vocab: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_v min(p(v), q(v)): the chance a speculatively sampled token is accepted.

    p_draft_vocab [N, K, d]: the target's probabilities of the draft tokens (they need not sum to
    1); q [N, K, d]: the draft's distribution. -> [N, K].
    """
    return torch.minimum(p_draft_vocab, q).sum(-1)


def slot_losses(
    logits: torch.Tensor,  # [N, K, d] draft logits
    p_target: torch.Tensor,  # [N, K, k] target probabilities of draft tokens (k = d: dense)
    labels: torch.Tensor,  # [N, K] the target's most likely draft-vocabulary token
    valid: torch.Tensor,  # [N, K] bool: slot has a supervised label
    w: LossWeights,
    confidence_logits: torch.Tensor | None = None,  # [N, K]
    *,
    total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    p_ids: torch.Tensor | None = None,  # [N, K, k] draft indices of p_target; None: dense
    greedy: torch.Tensor | None = None,  # [N, K] the target's greedy token, -1 out of reach
) -> dict[str, torch.Tensor]:
    """Weighted CE + TV (+ KL, + confidence BCE), with the acceptance each slot would get:
    `accept` when both sample, `greedy_accept` (given `greedy`) when both take their argmax.
    Each term is its slot-decayed sum over the supervised slots' count (speculators' reduction,
    held to it by tests/speculators/test_loss_terms.py).

    A sparse target (`p_ids`) gives the same values and gradients as its dense scatter: every
    term reads the draft only where the target has mass, except TV's, which the draft's mass
    elsewhere enters as a whole (sum_d |p - q| = sum_k (|p - q| - q) + 1).

    `total` sums a tensor over the data-parallel ranks that share the global batch (None: this
    process holds all of it). The normalizers are then the global batch's, so each rank's loss
    is its share of the global mean and the ranks' gradients add up to one process's."""
    k = logits.shape[1]
    mask = supervised_prefix(valid)
    logq = F.log_softmax(logits.float(), dim=-1)
    logq_p = logq if p_ids is None else logq.gather(-1, p_ids)  # [N, K, k]
    q_p = logq_p.exp()
    accept = acceptance(p_target, q_p)  # [N, K]
    # TV over the full vocabulary: mass the draft vocabulary lacks is all mismatch.
    outside = (1.0 - p_target.sum(-1)).clamp_min(0.0)
    if p_ids is None:
        mismatch = (p_target - q_p).abs().sum(-1)
    else:  # padding entries (p = 0) add |0 - q| - q = 0
        mismatch = ((p_target - q_p).abs() - q_p).sum(-1) + 1.0
    tv = 0.5 * (mismatch + outside)
    has_label = mask & (labels >= 0)
    ce = -logq.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    ce = torch.where(has_label, ce, torch.zeros_like(ce))

    weights = w.slot_weights(k).to(logits.device)[None, :] * mask  # [N, K]
    # Decayed sums over the supervised slots' count, as speculators reduces them: a slot's
    # weight scales its term, it does not renormalize the others.
    norm_m = mask.sum().to(logits.dtype)
    if total is not None:
        norm_m = total(norm_m)
    norm = norm_m.clamp_min(1.0)
    loss_ce = (ce * weights).sum() / norm
    loss_tv = (tv * weights).sum() / norm
    loss = w.ce * loss_ce + w.tv * loss_tv
    out = {"loss_ce": loss_ce, "loss_tv": loss_tv}
    if w.kl:
        p_hat = p_target / p_target.sum(-1, keepdim=True).clamp_min(1e-12)
        kl = (p_hat * (p_hat.clamp_min(1e-12).log() - logq_p)).sum(-1)
        out["loss_kl"] = loss_kl = (kl * weights).sum() / norm
        loss = loss + w.kl * loss_kl
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), accept.detach(), reduction="none"
        )
        loss_conf = (bce * mask).sum() / norm
        loss = loss + w.confidence * loss_conf
        out["loss_confidence"] = loss_conf
    out["loss"] = loss
    out["accept"] = accept.detach()
    out["mask"] = mask
    if greedy is not None:  # greedy decoding accepts a slot iff the two argmaxes agree
        out["greedy_accept"] = (logits.detach().argmax(-1) == greedy).to(accept.dtype)
    return out


@dataclass
class AcceptanceStats:
    """Running sums behind tau_sim and the per-slot acceptance; with greedy acceptance given
    (`add(..., greedy=)`), the same for greedy decoding, over the same blocks and slots."""

    k: int
    accept_sum: torch.Tensor | None = None  # [K]
    slot_count: torch.Tensor | None = None  # [K]
    tau_sum: float = 0.0
    blocks: int = 0
    greedy_sum: torch.Tensor | None = None  # [K]
    greedy_count: torch.Tensor | None = None  # [K] the supervised slots greedy was measured on
    greedy_tau_sum: float = 0.0
    greedy_blocks: int = 0
    decode_emitted: int = 0  # greedy decoding walked over the anchors (`add(..., at=)`)
    decode_steps: int = 0
    # Greedy acceptance of slot k over the blocks whose slots before k were all accepted: the
    # chain's links one by one, where pos_greedy mixes them with the slots before.
    cond_sum: torch.Tensor | None = None  # [K]
    cond_count: torch.Tensor | None = None  # [K]

    def __post_init__(self) -> None:
        self.accept_sum = torch.zeros(self.k, dtype=torch.float64)
        self.slot_count = torch.zeros(self.k, dtype=torch.float64)
        self.greedy_sum = torch.zeros(self.k, dtype=torch.float64)
        self.greedy_count = torch.zeros(self.k, dtype=torch.float64)
        self.cond_sum = torch.zeros(self.k, dtype=torch.float64)
        self.cond_count = torch.zeros(self.k, dtype=torch.float64)

    def add(
        self,
        accept: torch.Tensor,
        mask: torch.Tensor,
        greedy: torch.Tensor | None = None,
        at: torch.Tensor | None = None,  # [N, 2] each block's (row, anchor position)
    ) -> None:
        accept, mask = accept.detach().double().cpu(), mask.detach().cpu()
        self.accept_sum += (accept * mask).sum(0)
        self.slot_count += mask.sum(0)
        full = mask.all(-1)  # tau_sim only over blocks supervised in every slot
        if full.any():
            self.tau_sum += float(tau_sim(accept[full]).sum())
            self.blocks += int(full.sum())
        if greedy is not None:
            greedy = greedy.detach().double().cpu()
            self.greedy_sum += (greedy * mask).sum(0)
            self.greedy_count += mask.sum(0)
            before = torch.ones_like(greedy)  # slot 0 has nothing before it
            before[:, 1:] = greedy[:, :-1].cumprod(-1)
            reached = mask & (before > 0)
            self.cond_sum += (greedy * reached).sum(0)
            self.cond_count += reached.sum(0)
            if full.any():
                self.greedy_tau_sum += float(tau_sim(greedy[full]).sum())
                self.greedy_blocks += int(full.sum())
            if at is not None:
                self._walk(greedy, mask, at.cpu())

    def _walk(self, greedy: torch.Tensor, mask: torch.Tensor, at: torch.Tensor) -> None:
        """Each row decoded greedily over its anchors: from the first, a step at anchor p
        accepts the slots before its first miss and emits them and the target's own token, so
        the next step's anchor is p + run + 1. With every response position an anchor (the
        held-out evaluation) these are exactly the steps greedy decoding takes along the data,
        when the data is the target's greedy answer (see tau_greedy); a walk that reaches a
        position that is not an anchor (the answer's end) stops there."""
        run = (greedy * mask).cumprod(-1).sum(-1).long()  # [N] slots accepted in a row
        for row in at[:, 0].unique().tolist():
            mine = at[:, 0] == row
            runs = dict(zip(at[mine, 1].tolist(), run[mine].tolist(), strict=True))
            p = min(runs)
            while p in runs:
                self.decode_emitted += runs[p] + 1
                self.decode_steps += 1
                p += runs[p] + 1

    @property
    def pos_accept(self) -> list[float]:
        rate = self.accept_sum / self.slot_count.clamp_min(1)
        return [round(float(x), 4) for x in rate]

    @property
    def tau(self) -> float:
        return self.tau_sum / self.blocks if self.blocks else math.nan

    @property
    def measured_greedy(self) -> bool:
        """Whether any batch added carried greedy acceptance (see Batch.greedy)."""
        return bool(self.greedy_count.sum() > 0)

    @property
    def pos_greedy(self) -> list[float]:
        rate = self.greedy_sum / self.greedy_count.clamp_min(1)
        return [round(float(x), 4) for x in rate]

    @property
    def cond_greedy(self) -> list[float | None]:
        """Per slot, greedy acceptance given every earlier slot accepted (None: never reached)."""
        return [
            round(float(a / n), 4) if n else None
            for a, n in zip(self.cond_sum, self.cond_count, strict=True)
        ]

    @property
    def tau_greedy(self) -> float:
        """Greedy decoding's acceptance length: 1 + the run of slots whose draft argmax is the
        target's greedy token, each slot given the data's tokens before it. Greedy decoding
        gives it exactly those once the slots before it are accepted, if the data is the
        target's own greedy answer (prepare with greedy sampling and regenerate_fraction 1, as
        the default and full profiles are); on other answers it is an estimate."""
        return self.greedy_tau_sum / self.greedy_blocks if self.greedy_blocks else math.nan

    @property
    def tau_decode(self) -> float:
        """Greedy decoding's tau, tokens per verify step, over the walked rows (`_walk`).
        tau_greedy weighs every anchor alike and decoding every step alike: it crosses an easy
        stretch in a few long steps and spends a step on every token of a hard one, so where
        acceptance comes in stretches this is the lower."""
        return self.decode_emitted / self.decode_steps if self.decode_steps else math.nan


def tau_sim(accept: torch.Tensor) -> torch.Tensor:
    """[N, K] acceptance -> [N]: 1 + sum_k prod_{j<=k} accept_j, the expected tokens per step."""
    return 1.0 + accept.cumprod(dim=-1).sum(-1)
