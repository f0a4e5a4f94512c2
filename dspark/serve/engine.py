"""Continuous batching on the speculative decoder: requests come and go between steps.

The engine owns a pool of rows (one request each) and a loop (`run`, on the server's main
thread) that goes: free the rows of cancelled requests, admit waiting requests into free rows
(the lowest first, each with its own prefill, so a new request never waits for a running one to
end), then run one draft-and-verify step over the rows in use. A step covers rows 0..h-1, h one
past the highest busy row: in a closed loop the busy rows stay packed at the bottom, so the step
is no wider than the load.

Modes (what drafts, and how many drafts each row sends to verification):
    none             the target alone (k = 0)
    ngram            prompt lookup
    eagle3           the EAGLE-3 draft, its trained depth
    dflash           the DFlash draft, its whole block per row
    dspark_fixed     the DSpark draft, k drafts per row (k in params)
    dspark_adaptive  the DSpark draft, each step's budget and split from its calibrated
                     confidences (dspark.serve.scheduler), against the verify cost profiled
                     at start
    hybrid           per step and request, a suffix lookup's drafts or a trained draft's
                     block (`serve.hybrid.draft`), whichever is expected to get more accepted
                     (dspark.decode.hybrid)

With `serve.cost_model` on, ngram, eagle3, dflash and hybrid are planned as dspark_adaptive is,
from the acceptance measured per slot (hybrid: its own per-request estimates, calibrated): each
step verifies the drafts expected to emit the most tokens per millisecond, or none.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark.decode.decoder import SpecDecoder, keep
from dspark.decode.sampling import GREEDY, Sampling
from dspark.serve.scheduler import AdaptiveScheduler, VerifyCost


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    # Called on the engine's thread with (new tokens, finish reason or None); keep it cheap.
    on_tokens: Callable[[list[int], str | None], None]
    tokens: list[int] = field(default_factory=list)
    steps: int = 0  # verify steps (the prefill's token is not one)
    proposed: int = 0
    accepted: int = 0
    finish: str | None = None  # "stop" (EOS), "length", "cancelled" or "error"
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class EngineStats:
    """Totals since start, for the benchmark's cost split (read by GET /v1/dspark/stats).

    A step's wall time (`step_s`) is split into parts that follow one another, so they add up
    to it: drafting (proposing, the drafter's cache, a probe's catch-up), the target's verify
    pass, accepting (after the pass: the verdict, the new tokens written and delivered to their
    requests) and scheduling (the cost model: whether to draft, the plan, measuring what was
    accepted). Prefill (admitting a request) happens between steps, apart."""

    requests: int = 0
    tokens: int = 0
    steps: int = 0  # engine steps (one per batch, not per row)
    draft_steps: int = 0  # of them, those that drafted (the cost model skips some)
    row_steps: int = 0
    prefill_s: float = 0.0
    step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    schedule_s: float = 0.0

    def to_json(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class ServeEngine:
    def __init__(
        self,
        decoder: SpecDecoder,
        max_batch: int,
        max_len: int,
        sampling: Sampling = GREEDY,
        scheduler: AdaptiveScheduler | None = None,
        max_drafts: int | None = None,
        seed: int = 0,
    ):
        self.decoder, self.sampling = decoder, sampling
        self.scheduler, self.max_drafts = scheduler, max_drafts
        self.max_len = max_len
        self.rows = decoder.new_rows(max_batch, max_len)
        if scheduler is not None:
            scheduler.start(max_batch, decoder.proposer.k)
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.stats = EngineStats()
        self.gen = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # --- the caller's side (any thread) ----------------------------------------------------------

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can get."""
        return self.max_len - prompt_len - self.decoder.proposer.k - 1

    def submit(self, prompt: list[int], max_tokens: int, on_tokens) -> Request:
        if not prompt:
            raise ValueError("prompt: empty")
        if max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        longest = self.room(0) - 1  # the longest prompt that still gets one new token
        if len(prompt) > longest:
            raise ValueError(
                f"prompt: {len(prompt)} tokens, longer than this server's window holds: "
                f"{self.max_len} positions per request, at most {longest} of them prompt"
            )
        if max_tokens > self.room(len(prompt)):
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds this server's "
                f"{self.max_len} positions per request (at most {self.room(len(prompt))} here)"
            )
        self.decoder.check_fits(len(prompt), max_tokens, self.decoder.proposer.k)
        req = Request(list(prompt), max_tokens, on_tokens)
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"the engine stopped: {self.failure}")
            self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        self._wake.set()

    def busy(self) -> int:
        with self._lock:
            return sum(r is not None for r in self.slots) + len(self.waiting)

    def run(self) -> None:
        """The engine's loop, in the calling thread, until `stop`. Give it the main thread:
        torch runs this CPU's matmuls about 1.7x slower from any other (measured)."""
        self._loop()

    def start(self) -> None:
        """The loop in a thread of its own (tests; a server gives it the main thread)."""
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # --- the engine's thread ------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._free()
                self._admit()
                if bool(self.rows.active.any()):
                    self._step()
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a broken engine must not leave clients waiting forever
            self.failure = e
            with self._lock:
                pending = [r for r in self.slots if r is not None] + list(self.waiting)
                self.waiting.clear()
            for req in pending:
                self._finish(req, [], "error")
            raise

    def _finish(self, req: Request, tokens: list[int], reason: str) -> None:
        req.finish = reason
        req.on_tokens(tokens, reason)

    def _free(self) -> None:
        """Free the rows (and drop the waiting) of cancelled requests."""
        for r, req in enumerate(self.slots):
            if req is not None and req.cancelled:
                self.rows.active[r] = False
                with self._lock:
                    self.slots[r] = None
                self._finish(req, [], "cancelled")
        with self._lock:
            dropped = [q for q in self.waiting if q.cancelled]
            for q in dropped:
                self.waiting.remove(q)
        for q in dropped:
            self._finish(q, [], "cancelled")

    def _admit(self) -> None:
        while True:
            with self._lock:
                free = next((r for r, q in enumerate(self.slots) if q is None), None)
                if free is None or not self.waiting:
                    return
                req = self.waiting.popleft()
                self.slots[free] = req
            t0 = time.perf_counter()
            if self.scheduler is not None:  # the row's measured acceptance was another's
                self.scheduler.admit(free)
            first = self.decoder.admit(self.rows, free, req.prompt, self.sampling, self.gen)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.requests += 1
            self._deliver(free, req, [first])

    def _deliver(self, r: int, req: Request, new: list[int]) -> None:
        kept, go = keep(new, len(req.tokens), req.max_tokens, self.decoder.eos_id)
        req.tokens.extend(kept)
        self.stats.tokens += len(kept)
        if go:
            req.on_tokens(kept, None)
            return
        self.rows.active[r] = False
        with self._lock:
            self.slots[r] = None
        stop = bool(kept) and kept[-1] == self.decoder.eos_id
        self._finish(req, kept, "stop" if stop else "length")

    def _step(self) -> None:
        # Each part is charged from the mark before it, so the parts add up to the step's wall
        # time; the decoder's step times its own parts the same way.
        stats = self.stats
        start = time.perf_counter()
        busy = torch.nonzero(self.rows.active).flatten()
        span = slice(0, int(busy.max()) + 1)
        was_active = self.rows.active[span].clone()
        sched, prop = self.scheduler, self.decoder.proposer
        drafting = sched is None or sched.wants_draft()
        mark = time.perf_counter()
        stats.schedule_s += mark - start
        if drafting and prop.holding:
            # A probe first catches up on the context work held since the last one, timed apart:
            # it is not what a step costs once drafting pays, and counting it in the drafting
            # overhead would make drafting look dearer the longer it has been off.
            prop.flush()
            now = time.perf_counter()
            stats.draft_s += now - mark
            mark = now
        # Where drafting does not pay, the draft's per-step context work waits for the probes.
        prop.holding = sched is not None and not sched.pays
        st = self.decoder.step(
            self.rows,
            self.sampling,
            self.gen,
            span,
            plan=None if sched is None else sched.decide,
            max_drafts=self.max_drafts,
            draft=drafting,
        )
        now = time.perf_counter()
        stats.draft_s += st.draft_s
        stats.verify_s += st.verify_s
        stats.accept_s += st.accept_s
        # The decoder's parts cover its step but not the call itself (entering, returning, or
        # a preemption there on a busy machine): that rest is the engine's own, scheduling's.
        inside = st.draft_s + st.verify_s + st.accept_s + st.schedule_s
        stats.schedule_s += st.schedule_s + max(0.0, now - mark - inside)
        mark = now
        ran = torch.nonzero(was_active).flatten()
        if sched is not None and drafting and bool(st.proposed.any()):
            conf = None if st.confidence is None else st.confidence[ran]
            sched.observe(ran, st.proposed[ran], st.accepted[ran], conf)
            # What a drafting step pays besides verification: the draft and the plan.
            ms = (st.draft_s + st.schedule_s) * 1000
            sched.overhead_ms = 0.8 * sched.overhead_ms + 0.2 * ms if sched.overhead_ms else ms
        now = time.perf_counter()
        stats.schedule_s += now - mark
        mark = now
        stats.steps += 1
        stats.draft_steps += drafting and prop.k > 0
        for r in ran.tolist():
            req = self.slots[r]
            stats.row_steps += 1
            req.steps += 1
            req.proposed += int(st.proposed[r])
            req.accepted += int(st.accepted[r])
            self._deliver(r, req, st.tokens[r, : int(st.count[r])].tolist())
        end = time.perf_counter()
        stats.accept_s += end - mark
        stats.step_s += end - start


@torch.no_grad()
def profile_verify_cost(
    decoder: SpecDecoder,
    max_rows: int,
    context: int,
    counts: tuple[int, ...],
    repeats: int = 3,
) -> VerifyCost:
    """Time the target's verify pass by the number of tokens it verifies: n tokens spread over
    min(n, max_rows) rows, each row with `context` tokens already cached. The median of
    `repeats` runs after one warm-up."""
    target = decoder.target
    ms = []
    for n in counts:
        rows = min(n, max_rows)
        width = -(-n // rows)
        cache = target.new_cache(rows, context + width + 1)
        tokens = torch.randint(0, target.embed_tokens.num_embeddings, (rows, width))
        positions = context + torch.arange(width).expand(rows, width)
        valid = (torch.arange(rows * width) < n).view(rows, width)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            target(tokens, positions, cache, valid)
            times.append((time.perf_counter() - t0) * 1000)
        ms.append(sorted(times[1:])[len(times[1:]) // 2])
    return VerifyCost(tuple(counts), tuple(ms))
