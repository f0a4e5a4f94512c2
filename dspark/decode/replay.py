"""Greedy acceptance without the target's verify passes: the target's greedy path and hidden
states, recorded while it decodes each prompt once, are played back to the decoder in the
target's place.

Why this measures the same tau as decoding live: greedy verification accepts a draft exactly
when it equals the target's greedy next token, and every position a lossless decode verifies
from lies on the target's greedy path. So whatever the target would say at those positions, it
said while decoding that path. The decoder, the proposers and the verifier run unchanged on top
(`SpecDecoder(Playback(recording), proposer, ...)`): only the target's passes, most of a
speculative step's cost at low acceptance, are replaced. What can still differ is float noise
between the recorded passes and a verify pass (a near-tie flipping), which the evaluation
measures on the prompts it also decodes live.

A draft of k tokens verifies up to k - 1 positions past the path's last token (EOS or the cap),
so the recording runs `reach` = k - 1 greedy positions further, ignoring EOS.

Shape glossary: B rows, S recorded positions per row, T positions a call asks about, H hidden,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.decode.decoder import RowTrace, SpecDecoder, Timing
from dspark.decode.llama import KVCache, Llama
from dspark.decode.proposers import ALL, Proposer


@dataclass
class Recording:
    """The target along each row's prompt + greedy continuation (+ `reach` further)."""

    next_token: torch.Tensor  # [B, S] the greedy choice after each position
    feats: dict[int, torch.Tensor]  # {layer: [B, S, H]} outputs of the tapped layers
    lens: torch.Tensor  # [B] positions recorded in each row (the rest is padding)

    def rows(self, index: list[int]) -> Recording:
        pick = torch.tensor(index)
        return Recording(
            self.next_token[pick], {i: f[pick] for i, f in self.feats.items()}, self.lens[pick]
        )


class Recorder(Proposer):
    """Drafts nothing; keeps the target's tapped features of every position a step makes final
    (what a drafter's `extend` is given), so a plain decode leaves its hidden states behind."""

    def __init__(self, taps: tuple[int, ...]):
        self.taps = taps
        self.feats: dict[int, torch.Tensor] = {}

    def start(self, batch: int, slots: int) -> None:
        self.size = (batch, slots)
        self.feats = {}

    def extend(self, seq, start, count, feats, rows=ALL):
        t = next(iter(feats.values())).shape[1] if feats else 0
        offs = torch.arange(t)
        real = offs[None, :] < count[:, None]  # [b, T]
        pos = (start[:, None] + offs)[real]
        idx = torch.arange(self.size[0])[rows][:, None].expand(-1, t)[real]
        for i in self.taps:
            if i not in self.feats:
                self.feats[i] = feats[i].new_zeros(*self.size, feats[i].shape[-1])
            self.feats[i][idx, pos] = feats[i][real]


@torch.no_grad()
def decode_recorded(
    llama: Llama,
    eos_id: int,
    max_context: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    taps: tuple[int, ...],
    reach: int,
) -> tuple[list[RowTrace], Timing, Recording]:
    """The target's greedy decode of the prompts (batched, on our decoder), recording its tapped
    features and choices at every position, and `reach` greedy positions past each row's last
    token."""
    recorder = Recorder(taps)
    dec = SpecDecoder(llama, recorder, eos_id, max_context)
    pre = dec.prefill(prompts, max_new_tokens, taps=taps, draft_room=reach + 1)  # fits the reach
    traces, timing = dec.decode(pre, max_new_tokens)  # in place: pre keeps the final state
    b = len(prompts)
    idx = torch.arange(b)
    anchor = pre.lens + torch.tensor([len(t.tokens) for t in traces]) - 1  # not yet in cache
    seq, feats = pre.seq, recorder.feats
    for _ in range(reach + 1):  # the anchor, then the target's own tokens past the end
        logits, more = llama(seq[idx, anchor][:, None], anchor[:, None], pre.cache, taps=taps)
        seq[idx, anchor + 1] = logits[:, 0].argmax(-1)
        for i in taps:
            feats[i][idx, anchor] = more[i][:, 0]
        anchor = anchor + 1
    lens = anchor  # positions 0..anchor-1 are recorded
    next_token = torch.zeros_like(seq[:, :-1])  # the scratch column is not a position
    next_token[:, :-1] = seq[:, 1:-1]  # along each row the choice after t is token t + 1
    return traces, timing, Recording(next_token, feats, lens)


class Playback:
    """Stands in for the target's `Llama` in `SpecDecoder`: for the positions it is asked about,
    `greedy` returns the recorded greedy choices and a call one-hot logits on them, each with the
    recorded tapped features. Its cache is empty: nothing is computed."""

    def __init__(self, recording: Recording, vocab_size: int):
        self.rec, self.vocab_size = recording, vocab_size

    def new_cache(self, batch: int, slots: int) -> KVCache:
        empty = torch.zeros(0, batch, 0, slots + 1, 0)
        return KVCache(empty, empty.clone())

    def __call__(self, tokens, positions, cache, valid=None, taps=(), logits=True, logits_at=None):
        """As `greedy`, with one-hot logits [B, T or n, V] on the choices (a prefill's)."""
        if not logits:
            raise ValueError("playback has logits only: it records no final hidden state")
        choice, kept = self.greedy(tokens, positions, cache, valid, taps, logits_at)
        return torch.zeros(*choice.shape, self.vocab_size).scatter_(2, choice[..., None], 1.0), kept

    def greedy(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache,
        valid: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,  # [B, n]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The recorded choice after each asked position [B, T or n] and the tapped features:
        what a greedy step needs, without one-hot logits over the vocabulary (a [B, k+1, V]
        fill and its argmax were most of a replayed n-gram step)."""
        rec = self.rec
        if tokens.shape[0] != rec.lens.shape[0]:
            raise ValueError(f"playback of {rec.lens.shape[0]} rows asked about {len(tokens)}")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        beyond = valid & (positions >= rec.lens[:, None])
        if bool(beyond.any()):
            row = int(torch.nonzero(beyond)[0, 0])
            raise ValueError(
                f"playback: row {row} asked about position {int(positions[beyond].max())}, but "
                f"only {int(rec.lens[row])} were recorded (record with a longer reach)"
            )
        at = positions.clamp(0, rec.next_token.shape[1] - 1)  # padding reads anything in range
        asked = at if logits_at is None else at.gather(1, logits_at)
        choice = rec.next_token.gather(1, asked)  # [B, T or n]
        kept = {}
        for i in taps:
            f = rec.feats[i]
            kept[i] = f.gather(1, at[..., None].expand(-1, -1, f.shape[-1]))  # [B, T, H]
        return choice, kept
