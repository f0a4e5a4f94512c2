"""The hybrid proposer: each step and row, the suffix lookup's drafts or a trained draft's,
whichever is expected to have more of its drafts accepted.

Both sources propose every step. The expected accepted length of a proposal of k drafts is
sum_j prod_{i<=j} p_i, where p_i is the chance that slot i is accepted once the slots before it
are; each source's p_i is measured on the request itself, online:

    suffix  per slot and per match-length band (1, 2-3, 4-7, 8-15, 16+ tokens: a longer match
            is likelier to go on), each band's rate drawn toward the request's rate at that slot
            over every band until the band has trials of its own
    draft   per slot; with a confidence head (DSpark), this step's confidence at the slot times
            the measured ratio of acceptances to confidence there (how far the head is off on
            this request), so the head's view of this step counts and its bias is measured out

Every step both proposals are judged against the tokens the step emitted, not just the one that
was verified: slot j of either counts as a trial when the step emitted at least j tokens and the
proposal's slots before j matched them, and as accepted when its own token matched too. Under
greedy decoding that is exactly what verifying it would have found (the target's choice at a
position depends on the tokens before it only), so the source that lost keeps being measured and
can win back. Sampled, it is unbiased for the suffix lookup's one-hot drafts (a draft of token
t is accepted with probability p(t), the chance the emitted token is t) and an underestimate for
a sampled model draft (sum_v q(v) p(v) against sum_v min(p(v), q(v))).

The measurements are per request (reset when a row starts again at 0): a row's choices depend
on its own tokens only, so tau and the greedy tokens do not depend on the batch, and priors
(one accepted and one rejected trial, a confidence ratio of 1) hold until a few steps are in.
The draft is given the target's features every step whichever source won, so its caches stay
whole; the lookup is extended with every final token.

Shape glossary: B rows, M slots per row, K the widest proposal, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.decode.proposers import ALL, Proposal, Proposer
from dspark.decode.suffix import SuffixProposer, one_hot

BANDS = (1, 2, 4, 8, 16)  # the shortest match of each match-length band
SHRINK = 2.0  # pseudo-trials drawing a band's rate toward the slot's rate over every band


def band(matched: int) -> int:
    """A match length (at least 1) -> its band's index."""
    return max(sum(matched >= lo for lo in BANDS) - 1, 0)


def expected_accepted(p: np.ndarray) -> float:
    """p [k] per-slot conditional acceptance -> expected accepted drafts."""
    return float(np.cumprod(p).sum())


def judge(tokens: np.ndarray, emitted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tokens [k] a proposal, emitted [c] what the step emitted -> (tried [k], hit [k]) bool:
    slot j was decided (the step emitted at least j+1 tokens and slots before j matched), and
    it matched."""
    k = tokens.shape[0]
    w = min(k, emitted.shape[0])
    match = tokens[:w] == emitted[:w]
    tried = np.zeros(k, dtype=bool)
    tried[:w] = np.concatenate(([True], np.cumprod(match[:-1]).astype(bool)))[:w]
    hit = np.zeros(k, dtype=bool)
    hit[:w] = tried[:w] & match
    return tried, hit


class HybridProposer(Proposer):
    """`draft` and `suffix` side by side; each step, each active row verifies one of them. The
    proposal's confidence is the chosen source's estimated p_i, slot by slot."""

    name = "hybrid"

    def __init__(self, draft: Proposer, suffix: SuffixProposer, vocab_size: int | None = None):
        self.draft, self.suffix, self.vocab_size = draft, suffix, vocab_size
        self.k = max(draft.k, suffix.k)
        self.taps = draft.taps

    # `dspark_adaptive`-style holding is the draft's affair: pass it through.
    @property
    def holding(self) -> bool:
        return self.draft.holding

    @holding.setter
    def holding(self, value: bool) -> None:
        self.draft.holding = value

    def start(self, batch, slots):
        self.draft.start(batch, slots)
        self.suffix.start(batch, slots)
        self.won = {"suffix": 0, "draft": 0}  # row steps each source won since the start
        ks, kd = self.suffix.k, self.draft.k
        # Per row: trials and acceptances per slot (and band, for the suffix), and the draft's
        # summed confidence over its tried slots.
        self.s_tried = np.zeros((batch, len(BANDS), ks))
        self.s_hit = np.zeros((batch, len(BANDS), ks))
        self.d_tried = np.zeros((batch, kd))
        self.d_hit = np.zeros((batch, kd))
        self.d_conf = np.zeros((batch, kd))
        # The last proposals, until the step that verified them is extended: the anchor they
        # followed (-1: none), each source's tokens and count, the band, the confidences.
        self.anchor = np.full(batch, -1)
        self.s_tokens = np.zeros((batch, ks), dtype=np.int64)
        self.s_k = np.zeros(batch, dtype=np.int64)
        self.s_band = np.zeros(batch, dtype=np.int64)
        self.d_tokens = np.zeros((batch, kd), dtype=np.int64)
        self.d_k = np.zeros(batch, dtype=np.int64)
        self.d_confs = np.full((batch, kd), np.nan)  # nan: no confidence head

    def flush(self):
        self.draft.flush()

    def _reset(self, r: int) -> None:
        for a in (self.s_tried, self.s_hit, self.d_tried, self.d_hit, self.d_conf):
            a[r] = 0.0
        self.anchor[r] = -1

    def extend(self, seq, start, count, feats, rows=ALL):
        off = rows.start or 0
        for i in torch.nonzero(count).flatten().tolist():
            r, s, c = off + i, int(start[i]), int(count[i])
            if s == 0:  # a new request: nothing measured on another request counts
                self._reset(r)
            elif self.anchor[r] == s:  # the step that verified the last proposal
                self._measure(r, seq[i, s + 1 : s + 1 + c].numpy())
            self.anchor[r] = -1
        self.draft.extend(seq, start, count, feats, rows)
        self.suffix.extend(seq, start, count, feats, rows)

    def _measure(self, r: int, emitted: np.ndarray) -> None:
        ks, kd = int(self.s_k[r]), int(self.d_k[r])
        tried, hit = judge(self.s_tokens[r, :ks], emitted)
        self.s_tried[r, self.s_band[r], :ks] += tried
        self.s_hit[r, self.s_band[r], :ks] += hit
        tried, hit = judge(self.d_tokens[r, :kd], emitted)
        self.d_tried[r, :kd] += tried
        self.d_hit[r, :kd] += hit
        conf = self.d_confs[r, :kd]
        if not np.isnan(conf).any():
            self.d_conf[r, :kd] += np.where(tried, conf, 0.0)

    def suffix_rates(self, r: int, matched: int, k: int) -> np.ndarray:
        """-> [k] row r's measured P(slot accepted | slots before) for a match this long."""
        tried, hit = self.s_tried[r], self.s_hit[r]  # [bands, ks]
        pooled = (hit.sum(0) + 1.0) / (tried.sum(0) + 2.0)
        b = band(matched)
        return ((hit[b] + SHRINK * pooled) / (tried[b] + SHRINK))[:k]

    def draft_rates(self, r: int, conf: np.ndarray | None, k: int) -> np.ndarray:
        """-> [k] the same for the draft, from this step's confidences [k] where it has them."""
        if conf is None:
            return ((self.d_hit[r] + 1.0) / (self.d_tried[r] + 2.0))[:k]
        ratio = (self.d_hit[r, :k] + 1.0) / (self.d_conf[r, :k] + 1.0)
        return np.clip(conf * ratio, 0.0, 1.0)

    @torch.no_grad()
    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        d = self.draft.propose(seq, n, active, sampling, gen, rows)
        s_tokens, s_k, matched = self.suffix.lookup(seq, n, active, rows)
        b, off = seq.shape[0], rows.start or 0
        tokens, k_row = seq.new_zeros(b, self.k), seq.new_zeros(b)
        confidence = torch.zeros(b, self.k)  # the chosen source's p_i: P(accepted | before)
        use_suffix = torch.zeros(b, dtype=torch.bool)
        d_conf = None if d.confidence is None else d.confidence.double().numpy()
        for i in torch.nonzero(active).flatten().tolist():
            r, ks, kd = off + i, int(s_k[i]), int(d.k_row[i])
            p_s = self.suffix_rates(r, int(matched[i]), ks)
            p_d = self.draft_rates(r, None if d_conf is None else d_conf[i, :kd], kd)
            # A tie goes to the draft: its proposal is paid for whichever wins.
            if expected_accepted(p_s) > expected_accepted(p_d):
                use_suffix[i] = True
                tokens[i, :ks], k_row[i] = s_tokens[i, :ks], ks
                confidence[i, :ks] = torch.from_numpy(p_s)
                self.won["suffix"] += 1
            else:
                tokens[i, :kd], k_row[i] = d.tokens[i, :kd], kd
                confidence[i, :kd] = torch.from_numpy(p_d)
                self.won["draft"] += 1
            self.anchor[r] = int(n[i])
            self.s_tokens[r, :ks], self.s_k[r] = s_tokens[i, :ks].numpy(), ks
            self.s_band[r] = band(int(matched[i]))
            self.d_tokens[r, :kd], self.d_k[r] = d.tokens[i, :kd].numpy(), kd
            self.d_confs[r, :kd] = np.nan if d_conf is None else d_conf[i, :kd]
        q = None
        if not sampling.greedy:
            q = one_hot(tokens, self.vocab_size)  # [B, K, V]: right for the suffix's rows
            if d.q is not None:
                kd = d.q.shape[1]
                q[:, :kd] = torch.where(use_suffix[:, None, None], q[:, :kd], d.q)
                q[:, kd:] = torch.where(use_suffix[:, None, None], q[:, kd:], 0.0)
        return Proposal(tokens, k_row, q, confidence)
