"""Suffix lookup: drafts copied from where the row's own text last went on from its current end.

Each row keeps a suffix automaton (Blumer et al. 1985: the smallest automaton that reads every
substring; its suffix links form the suffix tree of the reversed text, the structure
ArcticInference's suffix decoding searches) over its prompt and its output so far. It grows by
one token at a time as the target makes tokens final, in amortized constant time plus at most
`max_match` small updates, never a rebuild of the row. A lookup finds the longest suffix of the
row, at most `max_match` tokens long, that also ended somewhere earlier, and proposes the tokens
that followed its most recent earlier occurrence. Unlike `ngram`'s fixed window the match may be
any length from 1 to `max_match`, and its length is reported (the hybrid proposer's evidence).

Which occurrence: the most recent. The longest match rarely has more than one earlier
occurrence; where it has several, the latest is what greedy decoding is most likely to repeat (a
loop repeats its last turn, a list its last item's form, code its latest use of a name), and it
is `ngram`'s choice too, so the two differ in the match only. The most frequent continuation
(ArcticInference's) would need occurrence counts, which a suffix automaton cannot keep up to date
in constant time per token. The continuation is copied as LZ77 copies: where it runs into the
row's end it goes on with the tokens it has just proposed, so a row repeating one token or a
short cycle gets a full k drafts rather than the few tokens left after the last occurrence.

Shape glossary: B rows, M slots per row, k drafted tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from dspark.decode.proposers import ALL, Proposal, Proposer


class SuffixIndex:
    """One row's text and its suffix automaton.

    A state stands for the substrings that end at the same set of positions (its end set). For
    each state whose strings include one of at most `max_match` tokens, `recent` is the latest
    position in its end set and `before` the one before it: a new token at position i sets
    `recent` to i on exactly those states whose strings end there, and they are the chain of
    suffix links from `window` (the state of the row's last min(max_match, length) tokens), at
    most `max_match` states. Longer states never become short (a state's shortest string only
    grows), so those values are exact wherever a lookup reads them."""

    def __init__(self, max_match: int):
        if max_match < 1:
            raise ValueError(f"max_match: must be at least 1, got {max_match}")
        self.max_match = max_match
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []
        # State 0 is the root: the empty string. Parallel lists, one entry per state.
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]  # suffix link: the state of the longest suffix in another end set
        self.length = [0]  # the longest string of the state
        self.recent = [-1]
        self.before = [-1]
        self.last = 0  # the state of the whole text
        self.window = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def _state(self, length: int, link: int, nxt: dict[int, int], recent: int, before: int):
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.recent.append(recent)
        self.before.append(before)
        return len(self.length) - 1

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        i = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        # The textbook online construction: every suffix state without an edge on `token` gets
        # one to `cur`; the first that has one decides cur's link, splitting its target when
        # that target also holds longer strings that do not end here.
        cur = self._state(length[self.last] + 1, -1, {}, -1, -1)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                # The clone's end set is q's plus i: it inherits q's positions, and the walk
                # below adds i where it matters.
                clone = self._state(
                    length[p] + 1, link[q], dict(nxt[q]), self.recent[q], self.before[q]
                )
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

        # The window slides by one: from the state of the last `had` tokens before this one
        # (a split may have moved them to the clone, one link up) along `token`, then one link
        # up if that string is one longer than the cap.
        w, had = self.window, min(self.max_match, i)
        while w and length[link[w]] >= had:
            w = link[w]
        w = nxt[w][token]
        if had == self.max_match and length[link[w]] >= self.max_match:
            w = link[w]
        self.window = w
        while w > 0:
            self.before[w] = self.recent[w]
            self.recent[w] = i
            w = link[w]

    def match(self) -> tuple[int, int]:
        """(m, e): the longest suffix of at most `max_match` tokens that also ends earlier, and
        the latest earlier position where it ends; (0, -1) when none does."""
        v = self.window
        m = min(self.max_match, len(self.tokens))
        while v > 0:
            if self.before[v] >= 0:
                return m, self.before[v]
            v = self.link[v]
            m = self.length[v]
        return 0, -1

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the match's latest earlier occurrence, copied on into
        the ones just proposed where they reach the row's end, and the match length."""
        m, e = self.match()
        if not m:
            return [], 0
        text, got = self.tokens, []
        n = len(text)
        for j in range(e + 1, e + 1 + k):
            got.append(text[j] if j < n else got[j - n])
        return got, m


class SuffixProposer(Proposer):
    """Suffix lookup over each row's prompt and output, one `SuffixIndex` per row, extended as
    the target makes tokens final."""

    name = "suffix"

    def __init__(self, k: int, max_match: int = 64, vocab_size: int | None = None):
        if k < 1:
            raise ValueError(f"k: must be at least 1, got {k}")
        if max_match < 1:
            raise ValueError(f"max_match: must be at least 1, got {max_match}")
        self.k, self.max_match, self.vocab_size = k, max_match, vocab_size
        self.index: list[SuffixIndex] = []

    def start(self, batch, slots):
        self.index = [SuffixIndex(self.max_match) for _ in range(batch)]

    def extend(self, seq, start, count, feats, rows=ALL):
        """Each gaining row's tokens through its new anchor (final too: the target chose it); a
        row starting again at 0 holds a new request."""
        off = rows.start or 0
        for i in torch.nonzero(count).flatten().tolist():
            index = self.index[off + i]
            if int(start[i]) == 0:
                index.clear()
            end = int(start[i]) + int(count[i]) + 1
            index.extend(seq[i, len(index) : end].tolist())

    def lookup(
        self, seq: torch.Tensor, n: torch.Tensor, active: torch.Tensor, rows: slice = ALL
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, k], k_row [B] and the match length [B] of each active row."""
        b = seq.shape[0]
        off = rows.start or 0
        tokens = seq.new_zeros(b, self.k)
        k_row, matched = seq.new_zeros(b), seq.new_zeros(b)
        for i in torch.nonzero(active).flatten().tolist():
            index, want = self.index[off + i], int(n[i]) + 1
            assert len(index) <= want, "a row's index ran past its anchor"
            index.extend(seq[i, len(index) : want].tolist())  # whatever no `extend` brought
            got, m = index.lookup(self.k)
            tokens[i, : len(got)] = torch.tensor(got)
            k_row[i], matched[i] = len(got), m
        return tokens, k_row, matched

    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        tokens, k_row, _ = self.lookup(seq, n, active, rows)
        q = None
        if not sampling.greedy:  # a deterministic draft: q is one-hot on the proposed token
            q = one_hot(tokens, self.vocab_size)
        return Proposal(tokens, k_row, q)


def one_hot(tokens: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """tokens [B, k] -> [B, k, V] one-hot: the distribution a copied draft was drawn from."""
    if vocab_size is None:
        raise ValueError("vocab_size: a copying proposer needs it to sample")
    b, k = tokens.shape
    return torch.zeros(b, k, vocab_size).scatter_(2, tokens[..., None], 1.0)
