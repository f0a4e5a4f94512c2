"""Speculative decoding of a batch of rows on our Llama forward.

Each step: the proposer drafts up to k tokens per row after the row's anchor (its last token,
not yet in the target's cache); the target runs [anchor, drafts] at the row's own positions in one
batched forward; the verifier accepts a prefix and adds the target's own next token (the bonus,
or the correction of the first rejected draft). So a step emits accepted + 1 tokens and `tau`
(tokens per target step) is 1 for plain decoding. Rows are ragged: each sits at its own position,
drafts its own number of tokens, and stops on its own at EOS or max_new_tokens.

The prefill's first token is counted apart (it is the time to first token, not a verify step).

Two ways in: `generate`/`decode` run a whole batch from one prefill to its end (the evaluation);
`Rows` + `admit` + `step` let a server admit a request into a free row between steps while the
other rows go on decoding (continuous batching).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dspark.decode.llama import KVCache, Llama
from dspark.decode.proposers import Proposal, Proposer
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
class Rows:
    """A pool of rows decoding side by side: what a step reads and advances. Row b's anchor,
    seq[b, n[b]], is its last token, not yet in the target's cache."""

    seq: torch.Tensor  # [B, slots+1] tokens, a scratch column last
    n: torch.Tensor  # [B] the anchor's position
    active: torch.Tensor  # [B] bool
    cache: KVCache

    @property
    def slots(self) -> int:
        return self.seq.shape[1] - 1


@dataclass
class Step:
    """What one step did to the rows it ran over (b of them), and where its time went: the
    parts follow one another, so they add up to the step."""

    proposed: torch.Tensor  # [b] drafts verified (0 for idle rows)
    accepted: torch.Tensor  # [b]
    tokens: torch.Tensor  # [b, w]: row i's first count[i] are its new tokens, in order
    count: torch.Tensor  # [b] accepted + 1 for active rows, else 0
    confidence: torch.Tensor | None  # [b, k] the draft's, when it has them
    draft_s: float  # proposing, and the drafter's own cache of the step's final positions
    verify_s: float  # the target's pass over [anchor, drafts]
    accept_s: float = 0.0  # after the pass: the verdict, the new tokens written, rows advanced
    schedule_s: float = 0.0  # the plan: how many drafts each row verifies


# (rows [a] the active rows' indices in the pool, k_row [a] drafts each proposed, conf [a, k]
# the draft's confidences or None) -> [a] how many drafts each sends to verification
Plan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def keep(tokens: list[int], have: int, max_new_tokens: int, eos_id: int) -> tuple[list[int], bool]:
    """A step's tokens for a row that has `have` -> (those kept up to EOS or the cap, whether
    the row goes on)."""
    kept = tokens[: max_new_tokens - have]
    if eos_id in kept:
        kept = kept[: kept.index(eos_id) + 1]
    done = have + len(kept) >= max_new_tokens or (bool(kept) and kept[-1] == eos_id)
    return kept, not done


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

    # --- a batch from one prefill to its end ---------------------------------------------------

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
        prop, seq, lens = self.proposer, pre.seq, pre.lens
        b = seq.shape[0]
        rows = Rows(seq, lens.clone(), torch.ones(b, dtype=torch.bool), pre.cache)
        if int(lens.max()) + max_new_tokens + prop.k + 1 > rows.slots:
            raise ValueError(f"the prefill left no room for {prop.name}'s {prop.k} drafts")
        traces = [RowTrace() for _ in range(b)]
        timing = Timing(prefill_s=pre.seconds)
        t0 = time.perf_counter()
        prop.start(b, rows.slots)
        first, _ = choose(pre.logits, sampling, gen)
        seq[torch.arange(b), lens] = first
        prop.extend(seq, torch.zeros_like(lens), lens, pre.feats)
        timing.draft_s += time.perf_counter() - t0
        for i, tr in enumerate(traces):
            tr.ttft_s = timing.prefill_s
            tr.tokens, go = keep([int(first[i])], 0, max_new_tokens, self.eos_id)
            rows.active[i] = go

        while rows.active.any():
            was_active = rows.active.clone()
            st = self.step(rows, sampling, gen)
            # The evaluation's split has two parts, as its recorded figures always had: the
            # step's bookkeeping counts with drafting (the serving engine keeps it apart).
            timing.draft_s += st.draft_s + st.accept_s + st.schedule_s
            timing.verify_s += st.verify_s
            for i in torch.nonzero(was_active).flatten().tolist():
                tr = traces[i]
                tr.accepted.append(int(st.accepted[i]))
                tr.proposed.append(int(st.proposed[i]))
                if st.confidence is not None:
                    tr.confidence.append(st.confidence[i, : int(st.proposed[i])].tolist())
                new = st.tokens[i, : int(st.count[i])].tolist()
                kept, go = keep(new, len(tr.tokens), max_new_tokens, self.eos_id)
                tr.tokens.extend(kept)
                tr.emitted.append(len(kept))
                rows.active[i] = go
        return traces, timing

    # --- rows that come and go (a server) ---------------------------------------------------------

    def new_rows(self, batch: int, slots: int) -> Rows:
        """An empty pool of `batch` rows of `slots` positions each."""
        self.proposer.start(batch, slots)
        return Rows(
            torch.zeros(batch, slots + 1, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.bool),
            self.target.new_cache(batch, slots),
        )

    @torch.no_grad()
    def admit(self, rows: Rows, r: int, prompt: list[int], sampling: Sampling, gen) -> int:
        """Prefill `prompt` into the free row r and make it active -> its first token.
        The row's old cache entries need no clearing: a query never reads past its position."""
        if rows.active[r]:
            raise ValueError(f"row {r} is busy")
        if len(prompt) + self.proposer.k + 2 > rows.slots:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit a row")
        one = slice(r, r + 1)
        cache = KVCache(rows.cache.k[:, one], rows.cache.v[:, one])
        length = len(prompt)
        rows.seq[r, :length] = torch.tensor(prompt)
        positions = torch.arange(length)[None]
        logits, feats = self.target(
            rows.seq[one, :length],
            positions,
            cache,
            taps=self.proposer.taps,
            logits_at=torch.tensor([[length - 1]]),
        )
        first, _ = choose(logits[:, 0], sampling, gen)
        rows.seq[r, length] = first[0]
        rows.n[r] = length
        self.proposer.extend(
            rows.seq[one], torch.zeros(1, dtype=torch.long), torch.tensor([length]), feats, one
        )
        rows.active[r] = True
        return int(first[0])

    @torch.no_grad()
    def step(
        self,
        rows: Rows,
        sampling: Sampling,
        gen: torch.Generator | None,
        span: slice = slice(None),
        plan: Plan | None = None,
        max_drafts: int | None = None,
        draft: bool = True,
    ) -> Step:
        """One draft-and-verify step over rows[span] (idle rows among them sit it out).
        `plan` may cut each active row's draft short (the serving engine's cost model);
        `max_drafts` caps every row's (a fixed k below the draft's block); `draft` False skips
        drafting (a plain step; the proposer still sees the new positions)."""
        t0 = time.perf_counter()
        prop = self.proposer
        seq, n, active = rows.seq[span], rows.n[span], rows.active[span]
        cache = KVCache(rows.cache.k[:, span], rows.cache.v[:, span])
        b, scratch = seq.shape[0], rows.slots
        idx = torch.arange(b)
        if draft:
            proposal = prop.propose(seq, n, active, sampling, gen, span)
        else:
            proposal = Proposal(seq.new_zeros(b, 0), seq.new_zeros(b))
        t1 = time.perf_counter()
        k_row = torch.where(active, proposal.k_row, 0)
        if max_drafts is not None:
            k_row = k_row.clamp_max(max_drafts)
        if plan is not None and bool(k_row.any()):
            act = torch.nonzero(active).flatten()
            conf = None if proposal.confidence is None else proposal.confidence[act]
            k_row[act] = torch.minimum(k_row[act], plan(act + (span.start or 0), k_row[act], conf))
        k = int(k_row.max())  # verify no wider than the longest draft kept
        drafts = proposal.tokens[:, :k]
        t2 = time.perf_counter()
        width = k + 1
        tokens = torch.cat((seq[idx, n][:, None], drafts), dim=1)  # [b, 1+k]
        positions = n[:, None] + torch.arange(width)
        valid = (torch.arange(width) <= k_row[:, None]) & active[:, None]
        if sampling.greedy:  # the target's choices only: a replay has no logits to make
            pred, taps = self.target.greedy(tokens, positions, cache, valid, taps=prop.taps)
            t3 = time.perf_counter()
            verdict = verify_greedy(drafts, pred, k_row)
        else:
            logits, taps = self.target(tokens, positions, cache, valid, taps=prop.taps)
            t3 = time.perf_counter()
            q = None if proposal.q is None else proposal.q[:, :k]
            verdict = verify_sampled(drafts, q, warp(logits, sampling), k_row, gen)

        a = verdict.accepted
        count = torch.where(active, a + 1, 0)
        offs = torch.arange(width)
        new = torch.cat((drafts, verdict.next_token[:, None]), 1)  # [b, k+1]
        new[idx, a] = verdict.next_token
        write = torch.where(offs[None, :] < count[:, None], n[:, None] + 1 + offs, scratch)
        seq[idx[:, None], write] = new
        start = n.clone()
        n += count
        t4 = time.perf_counter()
        prop.extend(seq, start, count, taps, span)  # the drafter's cache: its cost is drafting's
        t5 = time.perf_counter()
        return Step(
            k_row,
            a,
            new,
            count,
            proposal.confidence,
            draft_s=t1 - t0 + t5 - t4,
            verify_s=t3 - t2,
            accept_s=t4 - t3,
            schedule_s=t2 - t1,
        )
