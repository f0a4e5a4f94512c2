"""Labels, anchors and the context a slot may see, end to end on the tiny target: the extraction's
capture, the batch, the objectives' gathering and the drafts' masks agree on which token each slot
predicts. Off-by-one mistakes here are the classic cause of "loss falls, tau stays near 1".

The convention under test, from the decoder's side: after anchor p (the token the target just
emitted, its features not yet computed), slot j drafts token x_{p+j+1}, which the target predicts
from position p+j; the draft sees target features of positions before p only."""

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.data.shards import TokenSample
from dspark.extract.capture import HiddenStateCapture
from dspark.train.batch import TargetHead, collate
from dspark.train.losses import LossWeights
from dspark.train.objectives import (
    DSparkObjective,
    Eagle3Objective,
    anchor_candidates,
    gather_slots,
    pick_anchors,
)
from tests.unit.test_spec_decode import tiny_drafts

K = 4


@pytest.fixture(scope="module", params=["dense", "sparse"])
def greedy(varied, request):
    """Two prompts and the target's greedy continuations, captured as extraction captures them
    (full draft vocabulary, so the target's whole distribution is the draft's to match): the
    target rebuilt from the last hidden state (dense), or carried as its top-k with k the whole
    vocabulary (sparse)."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate((7, 12)):
        prompt = torch.randint(10, varied.vocab_size, (1, n), generator=gen)
        out = varied.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )[0]
        mask = torch.arange(out.shape[0]) >= n
        samples.append(TokenSample(i, f"p{i}", out.to(torch.int32), mask))
    topk = varied.vocab_size if request.param == "sparse" else 0
    capture = HiddenStateCapture(varied, [0, 1], "float32", topk)
    captured = [capture(s) for s in samples]
    capture.close()
    head = TargetHead(varied.norm, varied.lm_head, torch.arange(varied.vocab_size))
    return collate(captured, head)


def test_each_label_is_the_next_token_of_greedy_data(greedy):
    b = greedy
    for row in range(b.size):
        at = b.valid[row].nonzero()[:, 0]
        assert at.numel() >= 15
        # valid[t]: x_{t+1} is a response token, and the target's argmax at t is x_{t+1}
        assert torch.equal(b.labels[row, at], b.input_ids[row, at + 1])
        assert torch.equal(b.greedy[row, at], b.input_ids[row, at + 1])
        assert bool((b.greedy[row][~b.valid[row]] == -1).all())  # unsupervised: no greedy token
    anchors, ok = pick_anchors(anchor_candidates(b), None, None)
    slots = gather_slots(b, anchors, ok, K)
    labels, valid = slots.labels, slots.valid
    # slot j of anchor p is labelled x_{p+j+1}, wherever it is supervised
    want = b.input_ids.new_zeros(labels.shape)
    rows = torch.arange(b.size)[:, None].expand_as(anchors)[ok]
    for j in range(K):
        pos = (anchors[ok] + j + 1).clamp_max(b.input_ids.shape[1] - 1)
        want[:, j] = b.input_ids[rows, pos]
    assert valid.any(0).all()  # every slot is supervised somewhere
    assert torch.equal(labels[valid], want[valid])


class TargetAsDraft(torch.nn.Module):
    """A draft whose distribution is the target's: for anchor p, slot j's is the target's own
    at position p + `shift` + j, computed here from the target on the tokens (not from the batch).
    shift 0 is the convention; any other is an off-by-one."""

    def __init__(self, target, shift: int = 0):
        super().__init__()
        self.target, self.shift = target, shift
        self.cfg = type("Cfg", (), {"block_size": K, "draft_slots": K, "ttt_steps": K})()

    def _logits(self, input_ids, anchors, keep):
        with torch.no_grad():
            logp = F.log_softmax(self.target.model(input_ids=input_ids).logits, -1)  # [B, S, V]
        s = input_ids.shape[1]
        pos = (anchors[..., None] + self.shift + torch.arange(K)).clamp(0, s - 1)  # [B, A, K]
        rows = torch.arange(input_ids.shape[0])[:, None, None]
        return logp[rows, pos][keep]  # [N, K, V]

    def forward_train(self, input_ids, aux, anchors, keep):
        return self._logits(input_ids, anchors, keep), None

    def forward_ttt(self, input_ids, aux, chains, keep):
        return self._logits(input_ids, chains, keep)


@pytest.mark.parametrize(
    "objective",
    [
        DSparkObjective(LossWeights()),
        Eagle3Objective(LossWeights()),
        Eagle3Objective(LossWeights(), max_anchors=5),  # sampled chains keep the alignment
    ],
)
def test_a_draft_equal_to_the_target_is_accepted_on_every_slot(objective, greedy, varied):
    # eval mode: greedy acceptance is measured on held-out batches, never while training
    out = objective(TargetAsDraft(varied).eval(), greedy, torch.Generator().manual_seed(0))
    accept, mask = out["accept"], out["mask"]
    assert mask.sum() > 20
    assert torch.allclose(accept[mask], torch.ones(int(mask.sum())), atol=1e-4)
    assert float(out["loss_tv"]) < 1e-4
    assert bool((out["greedy_accept"][mask] == 1).all())  # greedy decoding accepts it too
    trained = objective(TargetAsDraft(varied).train(), greedy, torch.Generator().manual_seed(0))
    assert "greedy_accept" not in trained
    # ... and the same draft one position off is not: the check can fail.
    off = objective(TargetAsDraft(varied, shift=1).eval(), greedy, torch.Generator().manual_seed(0))
    assert float(off["accept"][off["mask"]].mean()) < 0.5
    assert float(off["greedy_accept"][off["mask"]].mean()) < 0.5


def test_eagle3_unrolls_max_anchors_chains_drawn_as_dspark_draws_its_anchors(greedy, varied):
    gen = torch.Generator().manual_seed(3)
    every = Eagle3Objective(LossWeights())(TargetAsDraft(varied), greedy, gen)
    some = Eagle3Objective(LossWeights(), max_anchors=5)(TargetAsDraft(varied), greedy, gen)
    assert every["mask"].shape[0] == int(anchor_candidates(greedy).sum()) > 10
    assert some["mask"].shape[0] == 5 * greedy.size  # every row has more than 5 candidates
    # a data-parallel rank replays the draws of rows before its own: `skip` makes those draws
    a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    pick_anchors(anchor_candidates(greedy), 5, a)
    counts = [int(n) for n in anchor_candidates(greedy).sum(1)]
    Eagle3Objective(LossWeights(), max_anchors=5).skip(b, counts)
    assert torch.equal(a.get_state(), b.get_state())


def test_a_slot_sees_the_context_before_its_anchor_only(greedy, varied):
    """DSpark's block for anchor p reads target features of positions < p: changing them at p
    or later leaves its logits alone, changing them at p - 1 does not."""
    (dspark, _), _ = tiny_drafts(varied, block=K)
    dspark.requires_grad_(False)
    p = 10
    anchors, keep = torch.tensor([[p], [p]]), torch.ones(2, 1, dtype=torch.bool)
    base, _ = dspark.forward_train(greedy.input_ids, greedy.aux, anchors, keep)
    later = greedy.aux.clone()
    later[:, p:] += 1.0
    same, _ = dspark.forward_train(greedy.input_ids, later, anchors, keep)
    assert torch.allclose(base, same, atol=1e-6)
    before = greedy.aux.clone()
    before[:, p - 1] += 1.0
    moved, _ = dspark.forward_train(greedy.input_ids, before, anchors, keep)
    assert not torch.allclose(base, moved, atol=1e-3)
    assert math.isfinite(float(moved.sum()))
