"""The reduced draft vocabulary: the `d` target tokens the training responses use most.

On a CPU the draft's cost is dominated by its output head (49K x 576 for SmolLM2) and the Markov
projection of the same width; keeping the most frequent tokens cuts both by the vocabulary ratio
while covering nearly all of the target's probability mass on in-distribution text. Both drafts
use the same vocabulary, so neither gains from it over the other.

`draft_ids[i]` is the target id of draft token i, ascending. speculators stores the same map as
`d2t[i] = draft_ids[i] - i` (an offset) and `t2d` (a bool mask over the target vocabulary).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Counts of each target id among the samples' response (loss-masked) tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s.input_ids.to(torch.int64)[s.loss_mask.to(torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_ids(
    counts: torch.Tensor, size: int | None, always: Iterable[int] = ()
) -> torch.Tensor:
    """The `size` most frequent ids (ties to the lower id), `always` included, sorted.

    `size=None` or `size >= vocab` keeps the full vocabulary.
    """
    vocab = counts.numel()
    if size is None or size >= vocab:
        return torch.arange(vocab)
    forced = sorted({int(t) for t in always if 0 <= int(t) < vocab})
    score = counts.to(torch.float64).clone()
    score[forced] = float("inf")
    # A stable sort on -count keeps equal counts in id order, so the pick is deterministic.
    order = torch.sort(-score, stable=True).indices
    return order[:size].sort().values


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the draft index of each target id, -1 where it has none."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[draft_ids] = torch.arange(draft_ids.numel())
    return t2d
