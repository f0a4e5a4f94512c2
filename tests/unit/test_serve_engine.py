"""Continuous batching on the tiny target: requests admitted while others decode, in fewer rows
than requests, give each request exactly the target's greedy output alone, in every mode;
cancelling frees the row; the adaptive mode stops drafting where drafts cannot pay."""

import threading
import time

import pytest
import torch

from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.hybrid import HybridProposer
from dspark.decode.proposers import NgramProposer, NoProposer, Proposal, Proposer
from dspark.decode.suffix import SuffixProposer
from dspark.serve.engine import ServeEngine, profile_verify_cost
from dspark.serve.scheduler import AdaptiveScheduler, VerifyCost
from tests.unit.conftest import NEW
from tests.unit.test_spec_decode import tiny_dflash, tiny_drafts

FLAT = VerifyCost((1, 64), (10.0, 10.0))  # verifying more costs nothing: draft all you can
STEEP = VerifyCost((1, 2), (10.0, 1000.0))  # every extra token costs 100x a step: never
# A draft or two are cheap, a block dear: the plan cuts blocks short.
MIXED = VerifyCost((1, 2, 3, 4, 8), (10.0, 11.0, 12.0, 20.0, 60.0))


class Collector:
    """A request's callback: the tokens as they arrive, and an event at the end."""

    def __init__(self):
        self.tokens, self.finish, self.done = [], None, threading.Event()

    def __call__(self, tokens, finish):
        self.tokens.extend(tokens)
        if finish is not None:
            self.finish = finish
            self.done.set()


def serve(engine, prompts, stagger=True, max_tokens=NEW, collector=Collector):
    """Submit the prompts, each after the one before has produced a token (so later ones are
    admitted mid-decode), and wait for all."""
    engine.start()
    try:
        out = []
        for p in prompts:
            c = collector()
            engine.submit(p, max_tokens, c)
            out.append(c)
            while stagger and not c.tokens and not c.done.is_set():
                threading.Event().wait(0.005)
        for c in out:
            assert c.done.wait(60), "a request never finished"
        return out
    finally:
        engine.stop()


class RowOracle(Proposer):
    """Drafts the row's reference continuation, some tokens replaced by noise, a ragged count
    per row; it knows a row's request by the prompt at its start, wherever the row sits."""

    name, k = "row-oracle", 4

    def __init__(self, prompts, reference, vocab):
        self.known = [(p, p + r + [0] * 8) for p, r in zip(prompts, reference, strict=True)]
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(3)

    def continuation(self, seq, n, active):
        """[B, k] each active row's next k reference tokens after its anchor."""
        tokens = torch.zeros(seq.shape[0], self.k, dtype=torch.long)
        for i in torch.nonzero(active).flatten().tolist():
            full = next(f for p, f in self.known if seq[i, : len(p)].tolist() == p)
            at = int(n[i]) + 1
            tokens[i] = torch.tensor(full[at : at + self.k])
        return tokens

    def propose(self, seq, n, active, sampling, gen, rows=slice(None)):
        b = seq.shape[0]
        tokens = self.continuation(seq, n, active)
        noise = torch.randint(0, self.vocab, tokens.shape, generator=self.gen)
        keep = torch.rand(tokens.shape, generator=self.gen) < 0.7
        k_row = torch.randint(0, self.k + 1, (b,), generator=self.gen)
        return Proposal(torch.where(keep, tokens, noise), k_row)


class LowHead(RowOracle):
    """Drafts each row's reference continuation exactly (every draft is accepted), with a
    confidence head that says 0.05 at every slot: a head biased far low."""

    def propose(self, seq, n, active, sampling, gen, rows=slice(None)):
        b = seq.shape[0]
        tokens = self.continuation(seq, n, active)
        return Proposal(tokens, torch.full((b,), self.k), None, torch.full((b, self.k), 0.05))


def proposer(which, varied, prompts, reference):
    dspark, eagle = tiny_drafts(varied)
    return {
        "none": lambda: NoProposer(),
        "ngram": lambda: NgramProposer(4, 1, 3),
        "random": lambda: RowOracle(prompts, reference, varied.vocab_size),
        "eagle3": lambda: Eagle3Proposer(*eagle),
        "dflash": lambda: DFlashProposer(*tiny_dflash(varied)),
        "dspark_fixed": lambda: DSparkProposer(*dspark),
        "dspark_adaptive": lambda: DSparkProposer(*dspark),
        "hybrid": lambda: HybridProposer(DSparkProposer(*dspark), SuffixProposer(4)),
    }[which]()


@pytest.mark.parametrize(
    "which", ["none", "ngram", "random", "eagle3", "dspark_fixed", "dspark_adaptive", "hybrid"]
)
def test_requests_batched_as_they_come_decode_as_alone(which, llama, varied, prompts, reference):
    prop = proposer(which, varied, prompts, reference)
    dec = SpecDecoder(llama, prop, varied.eos_token_id, max_context=2048)
    engine = ServeEngine(
        dec,
        max_batch=2,
        max_len=96,
        scheduler=AdaptiveScheduler(FLAT) if which == "dspark_adaptive" else None,
        max_drafts=2 if which == "dspark_fixed" else None,
    )
    # Three requests in two rows: the third waits for a row, then joins a running batch.
    out = serve(engine, prompts)
    assert [c.tokens for c in out] == reference
    assert all(c.finish in ("stop", "length") for c in out)
    assert engine.busy() == 0 and not engine.rows.active.any()
    assert engine.stats.requests == len(prompts)
    if which in ("dspark_fixed", "dspark_adaptive", "eagle3", "hybrid"):
        assert engine.stats.draft_s > 0
    if which in ("ngram", "random", "eagle3", "dspark_fixed", "hybrid"):
        assert engine.stats.draft_steps == engine.stats.steps
    if which == "none":
        assert engine.stats.draft_steps == 0
    if which == "hybrid":  # every row of every step chose a source
        assert sum(prop.won.values()) == engine.stats.row_steps
    if which == "random":  # drafts were verified, some accepted, some not
        assert engine.stats.tokens > engine.stats.row_steps + engine.stats.requests


@pytest.mark.parametrize("cost", ["mixed", "steep"])
@pytest.mark.parametrize(
    "which", ["ngram", "random", "eagle3", "dflash", "dspark_adaptive", "hybrid"]
)
def test_the_cost_model_keeps_every_modes_greedy_output(
    which, cost, llama, varied, prompts, reference
):
    """With the cost model planning every step (from measured rates, or calibrated confidences
    where the draft has them), each request still gets exactly the target's greedy output."""
    prop = proposer(which, varied, prompts, reference)
    dec = SpecDecoder(llama, prop, varied.eos_token_id, max_context=2048)
    sched = AdaptiveScheduler({"mixed": MIXED, "steep": STEEP}[cost], probe_every=2)
    engine = ServeEngine(dec, max_batch=2, max_len=96, scheduler=sched)
    out = serve(engine, prompts)
    assert [c.tokens for c in out] == reference
    assert engine.stats.requests == len(prompts)
    # It planned and measured: some drafts were verified (at least the probes' blocks). Not
    # for ngram: no token of these prompts and outputs repeats, so its lookup proposes nothing.
    proposes = which != "ngram"
    assert engine.stats.draft_steps >= 1
    assert (float(sched.meter.tried[0]) > 0) == proposes
    if cost == "steep" and proposes:  # no step drafts but the probes, a block each
        assert not sched.pays and engine.stats.draft_steps < engine.stats.steps


def test_a_head_biased_low_is_calibrated_and_the_mode_drafts(llama, varied, prompts):
    """A head that says 0.05 where drafts are accepted: as it speaks, drafting never pays at
    this cost; the probes measure it, and the calibrated mode verifies whole blocks."""
    cost = VerifyCost((1, 2, 5), (10.0, 15.0, 18.0))  # one extra token +50%, four +80%
    new = 64
    plain = SpecDecoder(llama, NoProposer(), varied.eos_token_id, 2048)
    reference = [t.tokens for t in plain.generate(prompts, new)[0]]
    head = LowHead(prompts, reference, varied.vocab_size)
    as_it_speaks = AdaptiveScheduler(cost)
    as_it_speaks.plan(torch.full((1, head.k), 0.05))
    assert not as_it_speaks.pays
    sched = AdaptiveScheduler(cost)
    engine = ServeEngine(
        SpecDecoder(llama, head, varied.eos_token_id, 2048), 1, 128, scheduler=sched
    )
    out = serve(engine, prompts, stagger=False, max_tokens=new)
    assert [c.tokens for c in out] == reference
    assert sched.pays and sched.probes <= 3
    # Lifted eightfold and more (not to 1: each request's last block runs past its end).
    assert sched.meter.calibrate(torch.full((1, head.k), 0.05)).min() > 0.4
    # Tokens after each prefill's first, per verify step: 1 for plain decoding, k+1 at most.
    # Uncalibrated, only the probes' blocks would be verified (about 1.1 here); calibrated,
    # after three probes over the first request, the rest verify whole blocks.
    tau = (engine.stats.tokens - engine.stats.requests) / engine.stats.row_steps
    assert tau > 2.0, tau


def test_adaptive_stops_drafting_where_it_cannot_pay(llama, varied, prompts, reference):
    dspark, _ = tiny_drafts(varied)
    prop = DSparkProposer(*dspark)
    dec = SpecDecoder(llama, prop, varied.eos_token_id, max_context=2048)
    scheduler = AdaptiveScheduler(STEEP, probe_every=4)
    engine = ServeEngine(dec, max_batch=4, max_len=96, scheduler=scheduler)
    requests = []
    real_plan = scheduler.plan

    def plan(conf, k_row=None):
        lengths = real_plan(conf, k_row)
        requests.append(int(lengths.sum()))
        return lengths

    scheduler.plan = plan
    out = serve(engine, prompts, stagger=False)
    assert [c.tokens for c in out] == reference
    # Nothing is worth verifying at that cost: each drafting step is a probe, verifying one
    # request's whole block only to go on measuring.
    assert set(requests) == {prop.k} and scheduler.probes == len(requests)
    assert not scheduler.pays
    # Drafting only every 4th step after the first: far fewer plans than steps.
    assert len(requests) <= engine.stats.steps // 4 + 2
    assert engine.stats.draft_steps == len(requests)
    state = scheduler.state()
    assert not state["pays"] and state["probe_interval"] >= 4 and len(state["curve"]) == prop.k


class SlowOracle(RowOracle):
    """RowOracle taking a known time to propose."""

    pause_s = 0.004

    def propose(self, *args, **kwargs):
        time.sleep(self.pause_s)
        return super().propose(*args, **kwargs)


class SlowClient(Collector):
    """A request's callback taking a known time per call (the server's hand-off to HTTP)."""

    pause_s, calls = 0.002, 0

    def __call__(self, tokens, finish):
        SlowClient.calls += 1
        time.sleep(self.pause_s)
        super().__call__(tokens, finish)


def test_a_steps_time_is_split_into_parts_that_add_up_to_it(llama, varied, prompts, reference):
    """Drafting, verifying, accepting (delivery included) and scheduling are timed one after
    another: they add up to the step's wall time, and a known delay in each lands in its own."""
    prop = SlowOracle(prompts, reference, varied.vocab_size)
    # Flat, and dear enough beside the delays below that drafting pays every step.
    sched = AdaptiveScheduler(VerifyCost((1, 64), (100.0, 100.0)))
    plans, real_decide, plan_pause = [], sched.decide, 0.003

    def decide(*args):
        plans.append(1)
        time.sleep(plan_pause)
        return real_decide(*args)

    sched.decide = decide
    engine = ServeEngine(
        SpecDecoder(llama, prop, varied.eos_token_id, 2048), 2, 96, scheduler=sched
    )
    SlowClient.calls = 0
    out = serve(engine, prompts, collector=SlowClient)
    assert [c.tokens for c in out] == reference
    st = engine.stats
    parts = st.draft_s + st.verify_s + st.accept_s + st.schedule_s
    assert parts == pytest.approx(st.step_s, rel=1e-9)  # chained marks: no time goes uncounted
    # Each known delay is in its own part and in no other.
    steps_calls = SlowClient.calls - st.requests  # each prefill's token is delivered apart
    assert st.draft_steps == st.steps and len(plans) > 0 and steps_calls > 0
    assert st.draft_s >= prop.pause_s * st.draft_steps
    assert st.schedule_s >= plan_pause * len(plans)
    assert st.accept_s >= SlowClient.pause_s * steps_calls
    known = prop.pause_s * st.draft_steps + plan_pause * len(plans)
    known += SlowClient.pause_s * steps_calls
    assert st.verify_s < st.step_s - known
    # (Had the plan's delay been charged to drafting, it would be past this.)
    assert st.draft_s < prop.pause_s * st.draft_steps + plan_pause * len(plans)
    assert st.prefill_s > 0 and st.step_s > 0


class SlowCatchUp(DSparkProposer):
    """DSpark whose catch-up on held context takes a known, long time."""

    pause_s = 0.5

    def flush(self):
        if self._holds:
            self.caught_up += 1
            time.sleep(self.pause_s)
        super().flush()


def test_a_probes_catch_up_is_not_counted_as_drafting_overhead(llama, varied, prompts):
    """Where drafting does not pay, DSpark's context work waits for the next probe. The probe's
    catch-up is timed apart from the drafting overhead the scheduler weighs (else the longer
    drafting is off, the dearer it looks), and still counted in the engine's draft time."""
    dspark, _ = tiny_drafts(varied)
    prop = SlowCatchUp(*dspark)
    prop.caught_up = 0
    dec = SpecDecoder(llama, prop, varied.eos_token_id, max_context=2048)
    scheduler = AdaptiveScheduler(STEEP, probe_every=4)
    engine = ServeEngine(dec, max_batch=4, max_len=96, scheduler=scheduler)
    serve(engine, prompts, stagger=False)
    assert prop.caught_up >= 2 and not scheduler.pays
    # 188 ms when the catch-up counted; a few ms of real drafting otherwise, with room for a
    # loaded machine.
    assert 0 < scheduler.overhead_ms < 1000 * prop.pause_s / 4
    assert engine.stats.draft_s >= prop.caught_up * prop.pause_s


def test_cancel_frees_the_row(llama, varied, prompts, reference):
    dec = SpecDecoder(llama, NoProposer(), varied.eos_token_id, max_context=2048)
    engine = ServeEngine(dec, max_batch=1, max_len=600)
    engine.start()
    try:
        long = Collector()
        req = engine.submit(prompts[0], 500, long)
        while len(long.tokens) < 2:
            threading.Event().wait(0.005)
        engine.cancel(req)
        assert long.done.wait(30) and long.finish == "cancelled"
        after = Collector()
        engine.submit(prompts[1], NEW, after)  # the only row is free again
        assert after.done.wait(60)
        assert after.tokens == reference[1]
    finally:
        engine.stop()
    assert engine.busy() == 0


def test_submit_rejects_what_cannot_fit(llama, varied, prompts):
    dec = SpecDecoder(llama, NoProposer(), varied.eos_token_id, max_context=2048)
    engine = ServeEngine(dec, max_batch=1, max_len=64)
    with pytest.raises(ValueError, match="max_tokens 60 exceeds this server's 64 positions"):
        engine.submit(prompts[0], 60, Collector())
    with pytest.raises(ValueError, match="prompt: empty"):
        engine.submit([], 4, Collector())
    # A prompt the window cannot hold is told so, with the window, never "at most -N" tokens.
    longest = 64 - engine.decoder.proposer.k - 2
    with pytest.raises(
        ValueError,
        match=rf"^prompt: 100 tokens, longer than this server's window holds: 64 positions "
        rf"per request, at most {longest} of them prompt$",
    ):
        engine.submit(list(range(1, 101)), 1, Collector())
    engine.submit(list(range(1, longest + 1)), 1, Collector())  # the longest still fits


def test_verify_cost_profile(llama, varied):
    dec = SpecDecoder(llama, NoProposer(), varied.eos_token_id, max_context=2048)
    cost = profile_verify_cost(dec, max_rows=4, context=32, counts=(1, 4, 16), repeats=1)
    assert cost.tokens == (1, 4, 16) and all(ms > 0 for ms in cost.ms)
    assert cost(8) > 0


def test_step_trims_the_verify_width_to_the_longest_draft(llama, varied, prompts, reference):
    """With max_drafts=1 every verify is 2 wide: the output is still the target's."""
    dspark, _ = tiny_drafts(varied)
    dec = SpecDecoder(llama, DSparkProposer(*dspark), varied.eos_token_id, max_context=2048)
    rows = dec.new_rows(3, 96)
    gen = torch.Generator().manual_seed(0)
    from dspark.decode.sampling import GREEDY

    got = [[dec.admit(rows, r, p, GREEDY, gen)] for r, p in enumerate(prompts)]
    while rows.active.any():
        was = rows.active.clone()
        st = dec.step(rows, GREEDY, gen, max_drafts=1)
        assert st.tokens.shape[1] <= 2 and int(st.proposed.max()) <= 1
        for r in torch.nonzero(was).flatten().tolist():
            got[r].extend(st.tokens[r, : int(st.count[r])].tolist())
            if len(got[r]) >= NEW or varied.eos_token_id in got[r]:
                rows.active[r] = False
    for g, want in zip(got, reference, strict=True):
        assert g[: len(want)] == want


def test_held_context_drafts_as_the_eager_one(llama, varied, prompts):
    """DSpark holds each step's features and builds their cache entries only when it drafts.
    Drafting now and then, with rows of ragged lengths, a row given a new request mid-way and
    prompts longer than the store, it drafts what a proposer writing every step does."""
    from dspark.decode.sampling import GREEDY

    dspark, _ = tiny_drafts(varied)
    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(10, varied.vocab_size, (20,), generator=gen).tolist()
    runs = []
    for holding in (False, True):  # False: every extend writes its entries at once
        prop = DSparkProposer(*dspark, held=5)
        prop.holding = holding
        dec = SpecDecoder(llama, prop, varied.eos_token_id, max_context=2048)
        rows = dec.new_rows(3, 96)
        g = torch.Generator().manual_seed(0)
        for r, p in enumerate(prompts[:2]):
            dec.admit(rows, r, p, GREEDY, g)
        seen = []
        for step in range(12):
            if step == 3:
                dec.admit(rows, 2, long_prompt, GREEDY, g)  # 20 positions > the store's 5
            if step == 6:
                rows.active[0] = False  # row 0's request ends; a new one takes the row
                dec.admit(rows, 0, prompts[2], GREEDY, g)
            st = dec.step(rows, GREEDY, g, draft=step % 3 == 2)
            seen.append((st.tokens.clone(), st.count.clone(), st.confidence))
        runs.append(seen)
    drafted = 0
    for (tok_a, count_a, conf_a), (tok_b, count_b, conf_b) in zip(*runs, strict=True):
        assert torch.equal(count_a, count_b) and torch.equal(tok_a, tok_b)
        assert (conf_a is None) == (conf_b is None)
        if conf_a is not None:
            drafted += 1
            torch.testing.assert_close(conf_a, conf_b, rtol=0, atol=1e-5)
    assert drafted == 4


@pytest.mark.parametrize("which", ["ngram", "eagle3", "hybrid"])
def test_one_stream_served_is_the_offline_decode_step_for_step(
    which, llama, varied, prompts, reference
):
    """At one stream a served request takes the steps, drafts and acceptances the offline
    decoder takes on the same prompt: what lets the benchmark call any served-vs-offline
    difference on the same prompts a defect (dspark.serve.offline)."""
    engine = ServeEngine(
        SpecDecoder(llama, proposer(which, varied, prompts, reference), varied.eos_token_id, 2048),
        max_batch=1,
        max_len=96,
    )
    engine.start()
    try:
        served = []
        for prompt in prompts[:2]:  # one at a time: a stream of one
            c = Collector()
            served.append((engine.submit(prompt, NEW, c), c))
            assert c.done.wait(60), "a request never finished"
    finally:
        engine.stop()
    offline = SpecDecoder(
        llama, proposer(which, varied, prompts, reference), varied.eos_token_id, 2048
    )
    for (req, c), prompt in zip(served, prompts[:2], strict=True):
        (trace,), _ = offline.generate([prompt], NEW)
        assert c.tokens == trace.tokens
        assert (req.steps, req.proposed, req.accepted) == (
            len(trace.accepted),
            sum(trace.proposed),
            sum(trace.accepted),
        )
