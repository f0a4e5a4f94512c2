"""Speculative decoding of a batch of rows on our Llama forward.

Each step: the proposer drafts up to k tokens per row after the row's anchor (its last token,
not yet in the target's cache); the target runs [anchor, drafts] at the row's own positions in one
batched forward; the verifier accepts a prefix and adds the target's own next token (the bonus,
or the correction of the first rejected draft). So a step emits accepted + 1 tokens and `tau`
(tokens per target step) is 1 for plain decoding. Rows are ragged: each sits at its own position,
drafts its own number of tokens, and stops on its own at EOS or max_new_tokens.

The prefill's first token is counted apart (it is the time to first token, not a verify step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from dspark.decode.llama import KVCache, Llama
from dspark.decode.proposers import Proposer
from dspark.decode.sampling import GREEDY, Sampling, choose, verify_greedy, verify_sampled, warp


@dataclass
class RowTrace:
    """One row's generation and its per-step record."""

    tokens: list[int] = field(default_factory=list)  # generated, EOS included if reached
    accepted: list[int] = field(default_factory=list)  # per verify step
    proposed: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # tokens kept (a stop truncates the last)
    confidence: list[list[float]] = field(default_factory=list)  # per step, per slot proposed
    ttft_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted)


@dataclass
class Prefill:
    """The target's pass over a batch of prompts: what every proposer starts from."""

    seq: torch.Tensor  # [B, slots+1] the prompts, room after them, a scratch column
    lens: torch.Tensor  # [B]
    cache: KVCache
    logits: torch.Tensor  # [B, V] at each prompt's last token
    feats: dict[int, torch.Tensor]  # {layer: [B, S, H]}
    seconds: float

    def copy(self) -> Prefill:
        cache = KVCache(self.cache.k.clone(), self.cache.v.clone())
        return replace(self, seq=self.seq.clone(), cache=cache)


@dataclass
class Timing:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.draft_s + self.verify_s


class SpecDecoder:
    def __init__(self, target: Llama, proposer: Proposer, eos_id: int, max_context: int):
        self.target, self.proposer = target, proposer
        self.eos_id, self.max_context = eos_id, max_context

    def check_fits(self, prompt_len: int, max_new_tokens: int, room: int) -> None:
        # A row decodes while it has fewer than max_new_tokens, so its anchor sits at most at
        # prompt_len + max_new_tokens - 2 and it verifies up to `room` positions past it.
        need = prompt_len + max_new_tokens + room - 1
        if need > self.max_context:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + a draft of "
                f"{room} exceeds the target's {self.max_context} positions"
            )

    @torch.no_grad()
    def prefill(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        taps: tuple[int, ...] | None = None,
        draft_room: int | None = None,
    ) -> Prefill:
        """The target's pass over the prompts. Reusable (`decode(..., fresh=True)`) by
        proposers that read no more than `taps` and draft no more than `draft_room` tokens."""
        taps = self.proposer.taps if taps is None else taps
        room = self.proposer.k if draft_room is None else draft_room
        for p in prompts:
            if not p:
                raise ValueError("an empty prompt")
            self.check_fits(len(p), max_new_tokens, room)
        t0 = time.perf_counter()
        b = len(prompts)
        lens = torch.tensor([len(p) for p in prompts])
        slots = int(lens.max()) + max_new_tokens + room + 1
        seq = torch.zeros(b, slots + 1, dtype=torch.long)  # + a scratch column
        for i, p in enumerate(prompts):
            seq[i, : len(p)] = torch.tensor(p)
        cache = self.target.new_cache(b, slots)
        width = int(lens.max())
        positions = torch.arange(width).expand(b, width)
        valid = positions < lens[:, None]
        logits, feats = self.target(
            seq[:, :width], positions, cache, valid, taps=taps, logits_at=(lens - 1)[:, None]
        )
        return Prefill(seq, lens, cache, logits[:, 0], feats, time.perf_counter() - t0)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
    ) -> tuple[list[RowTrace], Timing]:
        return self.decode(self.prefill(prompts, max_new_tokens), max_new_tokens, sampling, seed)

    @torch.no_grad()
    def decode(
        self,
        pre: Prefill,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        fresh: bool = False,
    ) -> tuple[list[RowTrace], Timing]:
        """Generation after a prefill; `fresh` works on copies, so the prefill serves again."""
        if fresh:
            pre = pre.copy()
        gen = torch.Generator().manual_seed(seed)
        prop, seq, lens, cache = self.proposer, pre.seq, pre.lens, pre.cache
        b = seq.shape[0]
        slots = seq.shape[1] - 1
        if int(lens.max()) + max_new_tokens + prop.k + 1 > slots:
            raise ValueError(f"the prefill left no room for {prop.name}'s {prop.k} drafts")
        rows = torch.arange(b)
        traces = [RowTrace() for _ in range(b)]
        timing = Timing(prefill_s=pre.seconds)
        t0 = time.perf_counter()
        prop.start(b, slots)
        first, _ = choose(pre.logits, sampling, gen)
        seq[rows, lens] = first
        n = lens.clone()  # the anchor's position
        prop.extend(seq, torch.zeros_like(lens), lens, pre.feats)
        timing.draft_s += time.perf_counter() - t0
        active = torch.ones(b, dtype=torch.bool)
        for i, tr in enumerate(traces):
            tr.ttft_s = timing.prefill_s
            active[i] = self._emit(tr, [int(first[i])], max_new_tokens)

        while active.any():
            t0 = time.perf_counter()
            draft = prop.propose(seq, n, active, sampling, gen)
            k_row = torch.where(active, draft.k_row, 0)
            t1 = time.perf_counter()
            width = draft.tokens.shape[1] + 1
            tokens = torch.cat((seq[rows, n][:, None], draft.tokens), dim=1)  # [B, 1+k]
            positions = n[:, None] + torch.arange(width)
            valid = (torch.arange(width) <= k_row[:, None]) & active[:, None]
            logits, taps = self.target(tokens, positions, cache, valid, taps=prop.taps)
            if sampling.greedy:
                verdict = verify_greedy(draft.tokens, logits, k_row)
            else:
                verdict = verify_sampled(draft.tokens, draft.q, warp(logits, sampling), k_row, gen)
            t2 = time.perf_counter()
            timing.draft_s += t1 - t0
            timing.verify_s += t2 - t1

            a = verdict.accepted
            count = torch.where(active, a + 1, 0)
            offs = torch.arange(width)
            new = torch.cat((draft.tokens, verdict.next_token[:, None]), 1)  # [B, k+1]
            new[rows, a] = verdict.next_token
            write = torch.where(offs[None, :] < count[:, None], n[:, None] + 1 + offs, slots)
            seq[rows[:, None], write] = new
            prop.extend(seq, n, count, taps)  # the drafter's cache: its cost is drafting's
            timing.draft_s += time.perf_counter() - t2
            for i in torch.nonzero(active).flatten().tolist():
                tr = traces[i]
                ai = int(a[i])
                tr.accepted.append(ai)
                tr.proposed.append(int(k_row[i]))
                if draft.confidence is not None:
                    tr.confidence.append(draft.confidence[i, : int(k_row[i])].tolist())
                active[i] = self._emit(tr, new[i, : ai + 1].tolist(), max_new_tokens)
            n = n + count
        return traces, timing

    def _emit(self, tr: RowTrace, tokens: list[int], max_new_tokens: int) -> bool:
        """Appends a step's tokens up to EOS or the cap -> whether the row goes on."""
        room = max_new_tokens - len(tr.tokens)
        kept = tokens[:room]
        if self.eos_id in kept:
            kept = kept[: kept.index(self.eos_id) + 1]
        tr.tokens.extend(kept)
        if tr.accepted:  # the prefill's token is not a verify step's
            tr.emitted.append(len(kept))
        return len(tr.tokens) < max_new_tokens and (not kept or kept[-1] != self.eos_id)
