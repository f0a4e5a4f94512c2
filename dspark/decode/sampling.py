"""Choosing tokens and verifying drafts: greedy, and lossless rejection sampling.

Greedy verification accepts a drafted token while it equals the target's argmax, so the output is
the target's greedy output token for token. Rejection sampling (Leviathan et al., Chen et al.)
accepts draft token t, drawn from the draft's distribution q, with probability min(1, p(t)/q(t))
and on the first rejection draws from norm(max(p - q, 0)); the output is distributed exactly as
the target's p (after the same temperature and top-p warping), whatever q is.

Shape glossary: B rows, k drafted tokens per row, V the target's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities after temperature and top-p (nucleus) filtering.
    The nucleus is the smallest set of top tokens whose mass reaches top_p (the top one always)."""
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= s.top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def choose(
    logits: torch.Tensor, s: Sampling, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] -> tokens [B], and the distribution they were drawn from (None if greedy)."""
    if s.greedy:
        return logits.argmax(-1), None
    probs = warp(logits, s)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1), probs


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] drafted tokens accepted (a prefix)
    next_token: torch.Tensor  # [B] the target's token after them (a correction or the bonus)


def verify_greedy(
    drafts: torch.Tensor,  # [B, k]
    pred: torch.Tensor,  # [B, k+1] the target's greedy choice after the last token and each draft
    k_row: torch.Tensor,  # [B] drafts each row proposed (the rest of its k is padding)
) -> Verdict:
    k = drafts.shape[1]
    ok = (drafts == pred[:, :k]) & (torch.arange(k) < k_row[:, None])
    accepted = ok.long().cumprod(-1).sum(-1)
    return Verdict(accepted, pred.gather(1, accepted[:, None]).squeeze(1))


def verify_sampled(
    drafts: torch.Tensor,  # [B, k]
    q: torch.Tensor | None,  # [B, k, V] what the drafts were drawn from (None when k = 0)
    p: torch.Tensor,  # [B, k+1, V] the target's, warped the same way
    k_row: torch.Tensor,  # [B]
    gen: torch.Generator | None,
) -> Verdict:
    b, k = drafts.shape
    if q is None:
        q = p.new_zeros(b, k, p.shape[-1])
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
    q_d = q.gather(2, drafts[..., None]).squeeze(-1)
    u = torch.rand(b, k, generator=gen)
    ok = (u * q_d < p_d) & (torch.arange(k) < k_row[:, None])  # u < p/q; never where p is 0
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(b)
    p_at = p[rows, accepted]  # [B, V]
    q_pad = torch.cat((q, q.new_zeros(b, 1, q.shape[2])), dim=1)  # past the last draft: q = 0
    rejected = accepted < k_row
    q_at = torch.where(rejected[:, None], q_pad[rows, accepted], 0.0)
    residual = (p_at - q_at).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass, and then a rejection cannot happen.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    return Verdict(accepted, torch.multinomial(residual, 1, generator=gen).squeeze(-1))
