"""The suffix lookup and the hybrid proposer: the lookup finds what a brute-force search over
the row finds, extending each row one token at a time; the hybrid chooses per row by measured
acceptance, keeps its draft's caches whole whichever source wins, and keeps greedy output equal
to the target's own in ragged batches."""

import random

import numpy as np
import pytest
import torch

from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DSparkProposer
from dspark.decode.hybrid import HybridProposer, band, expected_accepted, judge
from dspark.decode.llama import Llama
from dspark.decode.proposers import ALL, NoProposer, Proposal, Proposer
from dspark.decode.sampling import GREEDY, Sampling
from dspark.decode.suffix import SuffixIndex, SuffixProposer
from tests.unit.conftest import NEW
from tests.unit.test_decode_as_trained import Spliced, check_as_trained
from tests.unit.test_spec_decode import tiny_drafts


def brute_lookup(tokens: list[int], max_match: int, k: int) -> tuple[list[int], int]:
    """The longest suffix of at most max_match tokens ending earlier too, by trying every
    length and position; k tokens copied on from its latest earlier end."""
    n = len(tokens)
    for m in range(min(max_match, n - 1), 0, -1):
        ends = [e for e in range(m - 1, n - 1) if tokens[e - m + 1 : e + 1] == tokens[n - m :]]
        if ends:
            out = list(tokens)
            for j in range(k):
                out.append(out[max(ends) + 1 + j])
            return out[n:], m
    return [], 0


@pytest.mark.parametrize("max_match", [1, 2, 3, 7, 64])
def test_suffix_lookup_matches_brute_force_on_random_rows(max_match):
    rng = random.Random(max_match)
    for _ in range(150):
        alphabet, k = rng.choice([1, 2, 3, 6, 50]), rng.choice([1, 3, 8])
        index, tokens = SuffixIndex(max_match), []
        for _ in range(rng.randint(1, 40)):
            chunk = [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
            index.extend(chunk)  # as accepted tokens arrive: several at a time
            tokens += chunk
            assert index.lookup(k) == brute_lookup(tokens, max_match, k), (tokens, k)


def test_suffix_lookup_continues_the_latest_occurrence_and_copies_into_itself():
    index = SuffixIndex(64)
    index.extend([1, 2, 9, 1, 2, 8, 1, 2])
    assert index.lookup(3) == ([8, 1, 2], 2)  # [1, 2] ended at 1 and 4: the latest goes on to 8
    index.clear()
    index.extend([5, 6, 7, 5, 6])
    assert index.lookup(5) == ([7, 5, 6, 7, 5], 2)  # past the row's end: its own proposal
    index.clear()
    index.extend([4, 4, 4])
    assert index.lookup(4) == ([4, 4, 4, 4], 2)
    index.clear()
    index.extend([1, 2, 3])
    assert index.lookup(4) == ([], 0)
    with pytest.raises(ValueError, match=r"^max_match: must be at least 1, got 0$"):
        SuffixIndex(0)
    with pytest.raises(ValueError, match=r"^k: must be at least 1, got 0$"):
        SuffixProposer(0)


def test_suffix_rows_grow_token_by_token_and_decode_losslessly(tiny_target, monkeypatch):
    """Each final token is appended to its row's index once: no row is ever rebuilt."""
    appended = []
    real = SuffixIndex.append
    monkeypatch.setattr(SuffixIndex, "append", lambda self, t: (appended.append(t), real(self, t)))
    flat = Llama.from_hf(tiny_target.model)  # it repeats itself, so lookups hit
    prompts = [[11, 12, 13, 14, 15] * 6, [7, 8, 9], [20, 21, 20, 21, 20]]
    plain = SpecDecoder(flat, NoProposer(), tiny_target.eos_token_id, 2048)
    ref = [t.tokens for t in plain.generate(prompts, NEW)[0]]
    proposer = SuffixProposer(4, vocab_size=tiny_target.vocab_size)
    dec = SpecDecoder(flat, proposer, tiny_target.eos_token_id, 2048)
    traces, _ = dec.generate(prompts, NEW)
    assert [t.tokens for t in traces] == ref
    assert sum(a for t in traces for a in t.accepted) > 0
    assert len(appended) == sum(len(index) for index in proposer.index)
    for index, p, t in zip(proposer.index, prompts, traces, strict=True):
        assert index.tokens[: len(p) + len(t.tokens)] == p + t.tokens


class Fixed(Proposer):
    """Proposes the same tokens (and confidences) for every row, each step."""

    name = "fixed"

    def __init__(self, tokens: list[int], confidence: list[float] | None = None, vocab=64):
        self.tokens, self.k, self.vocab = torch.tensor(tokens), len(tokens), vocab
        self.confidence = None if confidence is None else torch.tensor(confidence)
        self.extended = 0

    def extend(self, seq, start, count, feats, rows=ALL):
        self.extended += int(count.sum())

    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        b = seq.shape[0]
        conf = None if self.confidence is None else self.confidence.expand(b, self.k)
        q = None
        if not sampling.greedy:
            q = torch.full((b, self.k, self.vocab), 1.0 / self.vocab)
        return Proposal(self.tokens.expand(b, self.k), torch.full((b,), self.k), q, conf)


def _rows(texts: list[list[int]], width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.zeros(len(texts), width, dtype=torch.long)
    for i, t in enumerate(texts):
        seq[i, : len(t)] = torch.tensor(t)
    return seq, torch.tensor([len(t) - 1 for t in texts])


def _admit(h: HybridProposer, seq: torch.Tensor, n: torch.Tensor) -> None:
    """A new request in every row: its prompt up to the anchor, as the decoder's prefill."""
    h.extend(seq, torch.zeros_like(n), n, {})


def _step(h, seq, n, emitted: list[list[int]], sampling=GREEDY):
    """One propose, then the step's emitted tokens written after each anchor and extended."""
    active = torch.ones(len(n), dtype=torch.bool)
    out = h.propose(seq, n, active, sampling, None)
    count = torch.tensor([len(e) for e in emitted])
    for i, e in enumerate(emitted):
        seq[i, int(n[i]) + 1 : int(n[i]) + 1 + len(e)] = torch.tensor(e)
    h.extend(seq, n.clone(), count, {})
    n += count
    return out


def test_judging_counts_a_slot_once_the_slots_before_it_matched():
    tried, hit = judge(np.array([4, 5, 6, 7]), np.array([4, 5, 9]))
    assert tried.tolist() == [True, True, True, False]
    assert hit.tolist() == [True, True, False, False]
    tried, hit = judge(np.array([4, 5]), np.array([4, 5, 6]))  # the bonus is past the proposal
    assert tried.tolist() == [True, True] and hit.tolist() == [True, True]
    tried, hit = judge(np.array([1, 5]), np.array([4, 5]))
    assert tried.tolist() == [True, False] and hit.tolist() == [False, False]
    assert [band(m) for m in (1, 2, 3, 4, 7, 8, 16, 99)] == [0, 1, 1, 2, 2, 3, 4, 4]
    assert expected_accepted(np.array([0.5, 0.5])) == 0.75
    assert expected_accepted(np.array([])) == 0.0


def test_each_row_takes_the_source_its_own_measurements_favour():
    """Row 0 keeps copying [1, 2, 3]; row 1 goes on as the draft says. Both sources are judged
    every step, whichever was verified, and each row settles on the one that is right for it."""
    draft = Fixed([7, 8, 9])
    h = HybridProposer(draft, SuffixProposer(3))
    h.start(2, 64)
    seq, n = _rows([[1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 3]])
    _admit(h, seq, n)
    picks = []
    for _ in range(4):
        out = _step(h, seq, n, [[1, 2, 3], [7, 8, 9]])
        picks.append(out.tokens.tolist())
    assert picks[1:] == [[[1, 2, 3], [7, 8, 9]]] * 3
    assert draft.extended == 2 * (5 + 4 * 3)  # every position reaches the draft, whoever won
    # Row 0: the suffix's 3 slots were tried and hit every step (in whatever band its growing
    # match fell); the draft's first slot missed every step and nothing after it was tried.
    assert h.s_hit[0].sum(0).tolist() == [4, 4, 4] == h.s_tried[0].sum(0).tolist()
    assert h.d_tried[0].tolist() == [4, 0, 0] and h.d_hit[0].tolist() == [0, 0, 0]
    assert h.d_hit[1].tolist() == [4, 4, 4]
    # A new request in row 0 forgets what row 0 measured; row 1 keeps its own.
    h.extend(seq[:1], torch.tensor([0]), torch.tensor([5]), {}, slice(0, 1))
    assert h.s_tried[0].sum() == h.d_tried[0].sum() == 0 and h.d_tried[1].sum() == 12


def test_a_confident_draft_wins_until_its_measured_acceptance_says_otherwise():
    """DSpark's head says 0.9 at every slot; the draft then misses its first slot every time,
    so the measured ratio of acceptances to confidence takes the suffix's side."""
    h = HybridProposer(Fixed([7, 8], confidence=[0.9, 0.9]), SuffixProposer(2))
    h.start(1, 64)
    seq, n = _rows([[1, 2, 1, 2, 1]])
    _admit(h, seq, n)
    first = _step(h, seq, n, [[2, 1]])
    assert first.tokens.tolist() == [[7, 8]]  # 0.9 + 0.81 against the suffix's prior 0.5 + 0.25
    assert torch.allclose(first.confidence, torch.tensor([[0.9, 0.9]]))  # its p per slot
    for _ in range(3):
        last = _step(h, seq, n, [[2, 1]])
    assert last.tokens.tolist() == [[2, 1]]
    assert h.d_conf[0].tolist() == pytest.approx([3.6, 0.0])  # 4 tries of slot 0 at 0.9


def test_sampled_rows_carry_the_chosen_sources_distribution():
    vocab = 16
    h = HybridProposer(Fixed([7, 8], vocab=vocab), SuffixProposer(3, vocab_size=vocab), vocab)
    h.start(2, 64)
    seq, n = _rows([[1, 2, 1, 2, 1], [3, 4, 5]])
    _admit(h, seq, n)
    for _ in range(3):  # row 0 copies, row 1 goes the draft's way
        out = _step(h, seq, n, [[2, 1], [7, 8, 9]], Sampling(0.7, 1.0))
    assert out.tokens[0].tolist() == [2, 1, 2] and out.k_row.tolist() == [3, 2]
    assert torch.equal(out.q[0], torch.eye(vocab)[[2, 1, 2]])
    assert torch.equal(out.q[1, :2], torch.full((2, vocab), 1.0 / vocab))
    assert not out.q[1, 2].any()  # past the draft's block: padding


def test_hybrid_keeps_greedy_output_and_its_draft_whole(tiny_target):
    """Several rows, ragged acceptance, each source winning some steps: the output is the
    target's plain greedy output, and every block the DSpark draft proposed, whichever source
    won the step, is what its training forward drafts at that anchor of the final sequence (a
    draft that missed the features of a step the suffix won would not be)."""
    flat = Llama.from_hf(tiny_target.model)
    eos = tiny_target.eos_token_id
    gen = torch.Generator().manual_seed(0)
    vocab = tiny_target.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    prompts.append([11, 12, 13, 14, 15] * 6)
    new = 40
    ref = [t.tokens for t in SpecDecoder(flat, NoProposer(), eos, 2048).generate(prompts, new)[0]]
    (model, draft_ids), _ = tiny_drafts(tiny_target)
    final = [p + r for p, r in zip(prompts, ref, strict=True)]
    # The tiny draft is never right alone: a random prefix of the right continuation in front.
    draft = Spliced(DSparkProposer(model, draft_ids), [f + [0] * 5 for f in final])
    h = HybridProposer(draft, SuffixProposer(4, vocab_size=vocab))
    traces, _ = SpecDecoder(flat, h, eos, 2048).generate(prompts, new)

    assert [t.tokens for t in traces] == ref
    assert h.won["suffix"] > 0 and h.won["draft"] > 0
    steps = [(a, p) for t in traces for a, p in zip(t.accepted, t.proposed, strict=True)]
    assert any(0 < a < p for a, p in steps) and any(a == p > 0 for a, p in steps)
    checked = check_as_trained("dspark", model, draft_ids, flat, final, draft.steps)
    assert checked == sum(len(t.accepted) for t in traces)


def test_hybrid_sampled_decoding_runs(llama, varied, prompts):
    (model, draft_ids), _ = tiny_drafts(varied)
    vocab = varied.vocab_size
    h = HybridProposer(DSparkProposer(model, draft_ids), SuffixProposer(4, vocab_size=vocab), vocab)
    dec = SpecDecoder(llama, h, varied.eos_token_id, 2048)
    traces, _ = dec.generate(prompts, NEW, Sampling(0.7, 0.9), seed=1)
    assert all(0 < len(t.tokens) <= NEW for t in traces)
