"""Proposers: what drafts the tokens the target verifies.

The decoder keeps every row's tokens in `seq` [B, M]. Row b's last token, `seq[b, n_b]`, is not
yet in the target's cache: it is the anchor the next draft continues from. After each target pass
the decoder calls `extend` with the target's features for the positions that pass made final, so a
model-based proposer keeps its own cache of them. Both calls may cover a contiguous run of the
rows `start` allocated (`rows`): a server admits one row, or steps only the rows in use.

    none    drafts nothing: plain decoding, one token per target step
    ngram   prompt lookup: the tokens that followed the latest earlier occurrence of the longest
            suffix n-gram (vLLM's `ngram` method; its default window is n = 5..5)
    suffix  the same lookup over a suffix automaton of each row's prompt and output, grown
            token by token: the longest suffix of any length up to a cap, continued from its
            latest earlier occurrence (`dspark.decode.suffix`; the hybrid's, not a method)
    hybrid  per step and row, the suffix lookup's drafts or a trained draft's, whichever the
            row's own measured acceptance expects to get more accepted (`dspark.decode.hybrid`)

The model-based proposers (DSpark, EAGLE-3, DFlash) live in `dspark.decode.drafters`.

Shape glossary: B rows, M slots per row, T new positions, k drafted tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.decode.sampling import Sampling

ALL = slice(None)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] target-vocabulary ids (padding past k_row)
    k_row: torch.Tensor  # [B] how many each row proposes
    q: torch.Tensor | None = None  # [B, k, V] what they were drawn from (sampling only)
    confidence: torch.Tensor | None = None  # [B, k] predicted P(slot accepted | slots before)


class Proposer:
    name = "none"
    k = 0  # the most tokens it drafts per step
    taps: tuple[int, ...] = ()  # target layers whose outputs it reads
    # A hint from whoever drives it: drafts are rare for now, so work `extend` would do every
    # step may wait for the next `propose` (DSpark's context cache does).
    holding: bool = False

    def start(self, batch: int, slots: int) -> None:
        """A new batch of rows with `slots` positions each."""

    def flush(self) -> None:
        """Do the work held while `holding` (`propose` does it first in any case)."""

    def extend(
        self,
        seq: torch.Tensor,  # [B, M]
        start: torch.Tensor,  # [B] first position the features are for
        count: torch.Tensor,  # [B] how many positions each row gained (0 for idle rows)
        feats: dict[int, torch.Tensor],  # {layer: [B, T, H]}, row b's first count[b] are real
        rows: slice = ALL,  # which of the rows `start` allocated these B are
    ) -> None:
        """The target's features for positions start..start+count-1 are now final."""

    def propose(
        self,
        seq: torch.Tensor,
        n: torch.Tensor,  # [B] the anchor's position
        active: torch.Tensor,  # [B] bool
        sampling: Sampling,
        gen: torch.Generator | None,
        rows: slice = ALL,
    ) -> Proposal:
        b = seq.shape[0]
        return Proposal(seq.new_zeros(b, 0), seq.new_zeros(b))


class NoProposer(Proposer):
    """Target only (k = 0): plain autoregressive decoding on the same decoder."""


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, k: int, min_n: int = 5, max_n: int = 5, vocab_size: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram window: need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.vocab_size = vocab_size

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram, n from max_n down to min_n; empty when none occurs."""
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0..length-n-1: never the suffix itself, always a token after.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + self.k]
        return tokens[:0]

    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        b = seq.shape[0]
        tokens = seq.new_zeros(b, self.k)
        k_row = seq.new_zeros(b)
        rows = seq.numpy()
        for i in torch.nonzero(active).flatten().tolist():
            found = self.lookup(rows[i, : int(n[i]) + 1])
            tokens[i, : found.shape[0]] = torch.from_numpy(found.copy())
            k_row[i] = found.shape[0]
        q = None
        if not sampling.greedy:  # a deterministic draft: q is one-hot on the proposed token
            q = torch.zeros(b, self.k, self.vocab_size).scatter_(2, tokens[..., None], 1.0)
        return Proposal(tokens, k_row, q)
