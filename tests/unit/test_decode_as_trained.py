"""Every step of a whole decode drafts what the training forward drafts at that anchor.

`test_spec_decode` checks the first block after the prefill. Here the drafts run through a
decode with ragged acceptance: the verifier is handed a random prefix of the right continuation
in front of the draft's own tokens, so each step accepts 0..k drafts and most tokens accepted
past the first slot are not the ones the draft proposed. A proposer whose cache kept a rejected
token's keys, dropped an accepted position's features or let a row see past its anchor drafts
differently from the training forward on the final sequence at that step's anchor, which is
what held-out acceptance measures. What this does not cover: the training data (the alignment
tests) and float noise between a full forward's features and the decode's (a tolerance).
"""

import pytest
import torch

from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.proposers import ALL, Proposal, Proposer
from tests.unit.conftest import NEW
from tests.unit.test_spec_decode import tiny_dflash, tiny_drafts

TAPS = (0, 1)
TIE = 1e-4  # logits this close to the maximum count as its argmax (float noise, not a bug)


class Recorded(Proposer):
    """`inner` as it is, keeping every step's anchors, active rows and proposal."""

    def __init__(self, inner: Proposer):
        self.inner = inner
        self.name, self.k, self.taps, self.holding = inner.name, inner.k, inner.taps, inner.holding
        self.steps: list[tuple[torch.Tensor, torch.Tensor, Proposal]] = []  # (n, active, own)

    def start(self, batch, slots):
        self.inner.start(batch, slots)

    def extend(self, seq, start, count, feats, rows=ALL):
        self.inner.extend(seq, start, count, feats, rows)

    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        own = self.inner.propose(seq, n, active, sampling, gen, rows)
        self.steps.append((n.clone(), active.clone(), own))
        return own


class Spliced(Recorded):
    """`inner`'s drafts with a prefix of the reference continuation in front: random (0..k
    slots, per row and step), or `cuts`' fixed length per row; `steps` keeps what `inner`
    itself proposed."""

    def __init__(
        self, inner: Proposer, full: list[list[int]], seed: int = 0, cuts: list[int] | None = None
    ):
        super().__init__(inner)
        self.full = full
        self.gen = torch.Generator().manual_seed(seed)
        self.cuts = None if cuts is None else torch.tensor(cuts)  # a fixed prefix per row

    def propose(self, seq, n, active, sampling, gen, rows=ALL):
        own = super().propose(seq, n, active, sampling, gen, rows)
        right = torch.tensor(
            [self.full[i][m + 1 : m + 1 + self.k] for i, m in enumerate(n.tolist())]
        )
        cut = (
            self.cuts
            if self.cuts is not None
            else torch.randint(0, self.k + 1, (len(n),), generator=self.gen)
        )
        front = torch.arange(self.k)[None, :] < cut[:, None]
        return Proposal(torch.where(front, right, own.tokens), own.k_row, None, own.confidence)


# The block-draft study's levers (DSparkConfig), each decoded as it was trained.
LEVERS = {
    "anchor_bonus": {"sample_from_anchor": False},
    "causal": {"block_attention": "causal"},
    "feature_first": {"feature_input": "first"},
    "feature_all_bonus": {"feature_input": "all", "sample_from_anchor": False},
}


def draft(varied, kind, block=4, levers=None):
    levers = levers or {}
    (dspark, ids), (eagle, _) = tiny_drafts(varied, block, **levers)
    if kind == "eagle3":
        return Eagle3Proposer(eagle, ids), eagle, ids
    if kind == "dflash":
        model, ids = tiny_dflash(varied, block, **levers)
        return DFlashProposer(model, ids), model, ids
    proposer = DSparkProposer(dspark, ids, held=16)
    proposer.holding = kind == "dspark_holding"  # `dspark_adaptive`'s deferred context writes
    return proposer, dspark, ids


def features(llama, ids: list[int]) -> torch.Tensor:
    """A full forward's tapped features of `ids` -> [S, L*H]."""
    cache = llama.new_cache(1, len(ids))
    with torch.no_grad():
        _, taps = llama(torch.tensor([ids]), torch.arange(len(ids))[None], cache, taps=TAPS)
    return torch.cat([taps[i][0] for i in TAPS], -1)


def trained_logits(kind, model, ids: list[int], aux: torch.Tensor, anchor: int):
    """The training forward's block at `anchor` of `ids`, teacher-forced on `ids` -> [K, d]."""
    seq = torch.tensor([ids])
    feats = torch.cat((aux[:anchor], aux.new_zeros(len(ids) - anchor, aux.shape[1])))[None]
    with torch.no_grad():
        if kind == "eagle3":
            return model.forward_ttt(seq, feats, torch.tensor([[anchor]]))[0]
        logits, _ = model.forward_train(seq, feats, torch.tensor([[anchor]]))
        return logits[0]


def check_as_trained(kind, model, draft_ids, llama, final, steps) -> int:
    """Every active row's draft of `steps` (a `Recorded`'s) against the training forward at
    its anchor of the final sequences, within TIE -> how many were checked."""
    aux = [features(llama, f) for f in final]
    checked = 0
    for n, active, own in steps:
        for row in torch.nonzero(active).flatten().tolist():
            anchor, drafted = int(n[row]), own.tokens[row]
            ids = final[row][: anchor + 1] + drafted.tolist()
            logits = trained_logits(kind, model, ids, aux[row], anchor)  # [K, d]
            picked = logits.gather(1, torch.searchsorted(draft_ids, drafted)[:, None])[:, 0]
            assert torch.all(picked >= logits.max(-1).values - TIE), (row, anchor, drafted)
            checked += 1
    return checked


CASES = [(kind, None) for kind in ("dspark", "dspark_holding", "dflash", "eagle3")] + [
    (kind, name) for name in LEVERS for kind in ("dspark", "dspark_holding", "dflash")
]


@pytest.mark.parametrize(("kind", "lever"), CASES)
def test_every_step_drafts_what_training_drafts_at_its_anchor(
    kind, lever, llama, varied, prompts, reference
):
    inner, model, draft_ids = draft(varied, kind, levers=LEVERS.get(lever))
    final = [p + r for p, r in zip(prompts, reference, strict=True)]
    spliced = Spliced(inner, [f + [0] * (inner.k + 1) for f in final])
    traces, _ = SpecDecoder(llama, spliced, varied.eos_token_id, 2048).generate(prompts, NEW)

    assert [t.tokens for t in traces] == reference  # lossless whatever was spliced in
    accepted = [a for t in traces for a in t.accepted]
    assert 0 in accepted and inner.k in accepted and any(0 < a < inner.k for a in accepted)

    checked = check_as_trained(kind, model, draft_ids, llama, final, spliced.steps)
    assert checked == sum(len(t.accepted) for t in traces)


@pytest.mark.parametrize(("kind", "lever"), [*CASES[:4], ("dspark", "feature_all_bonus")])
def test_a_row_that_ends_on_a_whole_block_leaves_the_others_decoding(
    kind, lever, llama, varied, prompts, reference
):
    """The longest prompt's row accepts every draft, so its last step ends k tokens past its
    budget while the other rows decode on. The drafter must keep the finished row's drafts
    inside its cache (EAGLE-3 wrote them up to 2k past the budget, one block more than the
    cache holds: run 5's evaluation, 2026-12-05)."""
    inner, _, _ = draft(varied, kind, block=6, levers=LEVERS.get(lever))
    k = inner.k
    budget = 2 * k + 4  # the first token, then three whole blocks of k + 1: k past the budget
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert all(len(r) >= budget for r in reference)
    final = [p + r for p, r in zip(prompts, reference, strict=True)]
    cuts = [k if i == longest else 0 for i in range(len(prompts))]
    spliced = Spliced(inner, [f + [0] * (k + 1) for f in final], cuts=cuts)
    traces, _ = SpecDecoder(llama, spliced, varied.eos_token_id, 2048).generate(prompts, budget)

    assert [t.tokens for t in traces] == [r[:budget] for r in reference]
    assert traces[longest].accepted == [k, k, k]
    others = [t for i, t in enumerate(traces) if i != longest]
    assert all(len(t.accepted) > 3 for t in others)  # still decoding after it ended
