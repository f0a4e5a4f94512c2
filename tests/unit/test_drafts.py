"""The drafts' structure: who attends to what, which tokens the Markov head reads, what the
confidence head is trained towards, which positions become anchors."""

import math

import pytest
import torch
from torch import nn

from dspark.models.dspark import DSparkConfig, DSparkDraft, block_mask
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.models.layers import LayerShape
from dspark.models.vocab import build_draft_ids
from dspark.train.batch import Batch
from dspark.train.losses import (
    AcceptanceStats,
    LossWeights,
    slot_losses,
    supervised_prefix,
    tau_sim,
)
from dspark.train.objectives import anchor_candidates, pick_anchors

SHAPE = LayerShape(
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position=512,
)
VOCAB = 50


def tiny_dspark(markov="vanilla", rank=8, block=4, seed=0) -> DSparkDraft:
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = DSparkConfig(
        layer=SHAPE,
        num_layers=2,
        block_size=block,
        aux_layers=(0, 1),
        vocab_size=VOCAB,
        draft_vocab_size=20,
        mask_token_id=VOCAB - 1,
        markov_rank=rank,
        markov_head=markov,
        confidence_head=True,
        confidence_with_markov=rank > 0,
    )
    model = DSparkDraft(cfg, embed, torch.randn(20, SHAPE.hidden_size))
    for p in model.parameters():  # away from the identity init, so every weight matters
        nn.init.normal_(p, std=0.2)
    return model.eval()


def test_block_mask_sees_only_earlier_context_and_its_own_block():
    anchors = torch.tensor([[3, 7]])
    mask = block_mask(anchors, block_size=4, ctx_len=10)[0]  # [8, 10 + 8]
    for q in range(8):
        anchor = 3 if q < 4 else 7
        assert mask[q, :10].tolist() == [j < anchor for j in range(10)]
        block = q // 4
        assert mask[q, 10:].tolist() == [(j // 4) == block for j in range(8)]


def test_a_block_ignores_later_context_and_other_blocks():
    """The mask, end to end: perturbing what a block must not see leaves its logits as they are."""
    model = tiny_dspark()
    s = 24
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (1, s), generator=gen)
    aux = torch.randn(1, s, 2 * SHAPE.hidden_size, generator=gen)
    anchors = torch.tensor([[5, 14]])
    with torch.no_grad():
        base, _ = model.forward_train(ids, aux, anchors)
        later = aux.clone()
        later[:, 5:] += 3.0  # context at and after the first anchor
        ids2 = ids.clone()
        ids2[0, 14] = (ids[0, 14] + 1) % (VOCAB - 1)  # the second block's anchor token
        moved, _ = model.forward_train(ids2, later, anchors)
    first = slice(0, 1)
    # Block 1 (anchor 5): its Markov inputs x_5..x_8 and context < 5 are untouched.
    assert torch.allclose(base[first], moved[first], atol=1e-5)
    assert not torch.allclose(base[1:], moved[1:], atol=1e-3)  # block 2 did see its changes


def test_markov_reads_the_anchor_then_the_true_previous_tokens():
    model = tiny_dspark(block=4)
    seen = {}
    original = model.heads

    def spy(hidden, prev):
        seen["prev"] = prev.clone()
        return original(hidden, prev)

    model.heads = spy
    ids = torch.arange(20)[None] % (VOCAB - 1)
    aux = torch.randn(1, 20, 2 * SHAPE.hidden_size)
    model.forward_train(ids, aux, torch.tensor([[3, 9]]))
    # slot 0 conditions on the anchor x_p, slot k on x_{p+k} (the truth slot k-1 predicts)
    assert seen["prev"].tolist() == [[3, 4, 5, 6], [9, 10, 11, 12]]


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn"])
def test_markov_variants_step_equals_block(variant):
    """Teacher-forced block bias and the slot-by-slot inference path agree."""
    model = tiny_dspark(markov=variant)
    head = model.markov_head
    prev = torch.randint(0, VOCAB, (3, 4))
    hidden = torch.randn(3, 4, SHAPE.hidden_size)
    with torch.no_grad():
        block = head.block_bias(prev, hidden)
        state, steps = None, []
        for k in range(4):
            bias, state = head.step(prev[:, k], hidden[:, k], state)
            steps.append(bias)
    assert torch.allclose(block, torch.stack(steps, 1), atol=1e-6)


def test_confidence_target_is_the_acceptance_rate():
    p = torch.tensor([[[0.5, 0.3, 0.2]]])  # target
    q = torch.tensor([0.2, 0.2, 0.6])  # draft
    logits = q.log()[None, None]
    conf = torch.tensor([[0.7]])
    out = slot_losses(
        logits, p, torch.tensor([[0]]), torch.tensor([[True]]), LossWeights(confidence=1.0), conf
    )
    assert out["accept"].item() == pytest.approx(0.6)  # min(.5,.2)+min(.3,.2)+min(.2,.6)
    bce = -(
        0.6 * math.log(torch.sigmoid(conf).item()) + 0.4 * math.log(1 - torch.sigmoid(conf).item())
    )
    assert out["loss_confidence"].item() == pytest.approx(bce, rel=1e-5)
    assert out["loss_tv"].item() == pytest.approx(0.4)


@pytest.mark.parametrize(
    "weights", [LossWeights(confidence=1.0), LossWeights(kl=1.0, decay=0.8, gamma=None)]
)
def test_a_sparse_target_gives_the_dense_losses_and_gradients(weights):
    """The target's top-k as draft indices and probabilities, padded with index 0 at
    probability 0 where a token left the draft vocabulary, scores every term and every
    gradient as its dense scatter does."""
    gen = torch.Generator().manual_seed(0)
    n, k_slots, d, k = 5, 3, 12, 4
    ids = torch.stack([torch.randperm(d, generator=gen)[:k] for _ in range(n * k_slots)])
    ids = ids.view(n, k_slots, k)
    probs = torch.rand(n, k_slots, k, generator=gen) * 0.2
    probs[0, 0, 3], ids[0, 0, 3] = 0.0, 0  # padding: a top-k token outside the draft vocabulary
    probs[1, 1, 2:], ids[1, 1, 2:] = 0.0, 0
    dense = torch.zeros(n, k_slots, d).scatter_add_(-1, ids, probs)
    labels = dense.argmax(-1)
    valid = torch.ones(n, k_slots, dtype=torch.bool)
    valid[2, 1] = False
    logits = torch.randn(n, k_slots, d, generator=gen) * 2
    conf = torch.randn(n, k_slots, generator=gen)

    def run(p, p_ids):
        x = logits.clone().requires_grad_(True)
        out = slot_losses(x, p, labels, valid, weights, conf, p_ids=p_ids)
        out["loss"].backward()
        return out, x.grad

    want, want_grad = run(dense, None)
    got, got_grad = run(probs, ids)
    for term in ("loss", "loss_ce", "loss_tv", "accept") + (("loss_kl",) if weights.kl else ()):
        torch.testing.assert_close(got[term], want[term], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


def test_greedy_acceptance_is_argmax_agreement_and_its_tau_runs_until_the_first_miss():
    """A slot is accepted greedily iff the draft's argmax is the target's greedy token; -1 (the
    target's token is outside the draft vocabulary) is never accepted, whatever the draft says.
    tau_greedy counts the run of accepted slots over the same blocks as tau_sim."""
    logits = torch.tensor([[[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]],
                           [[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]],
                           [[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]]])  # fmt: skip
    greedy = torch.tensor([[0, 1, 3], [-1, 1, 2], [0, 1, 2]])
    valid = torch.ones(3, 3, dtype=torch.bool)
    valid[2, 2] = False  # a block cut short: its slots count, it joins no tau
    p = torch.softmax(logits, -1)
    out = slot_losses(logits, p, p.argmax(-1), valid, LossWeights(), greedy=greedy)
    assert out["greedy_accept"].tolist() == [[1, 1, 0], [0, 1, 1], [1, 1, 1]]
    stats = AcceptanceStats(3)
    stats.add(out["accept"], out["mask"], out["greedy_accept"])
    assert stats.tau_greedy == pytest.approx((3 + 1) / 2)  # 1 + 1 + 1, then 1 + 0
    assert stats.pos_greedy == [0.6667, 1.0, 0.5]  # rounded as pos_accept is
    assert stats.blocks == stats.greedy_blocks == 2 and stats.measured_greedy
    plain = slot_losses(logits, p, p.argmax(-1), valid, LossWeights())
    assert "greedy_accept" not in plain  # no greedy tokens (a batch built by hand): no claim
    unknown = AcceptanceStats(3)
    unknown.add(plain["accept"], plain["mask"])
    assert not unknown.measured_greedy and math.isnan(unknown.tau_greedy)


def test_tau_decode_walks_the_anchors_as_greedy_decoding_steps():
    """A step at anchor p emits its run of accepted slots and the target's own token, so the
    next anchor is p + run + 1. Row 0 is an easy stretch then a hard one: decoding crosses the
    first in two long steps and spends a step on every token of the second, so tau_decode is
    below the mean over anchors (tau_greedy), which weighs every position alike."""
    k = 3
    runs0 = {p: 3 if p < 6 else 0 for p in range(12)}  # accepted slots at each anchor
    runs1 = {2: 0, 3: 3, 4: 0, 5: 0, 6: 0}  # 2 -> 3 -> 7, which is no anchor: the end
    at = torch.tensor([(0, p) for p in runs0] + [(1, p) for p in runs1])
    runs = [*runs0.values(), *runs1.values()]
    greedy = torch.tensor([[1.0] * r + [0.0] * (k - r) for r in runs])
    mask = torch.ones(len(runs), k, dtype=torch.bool)
    stats = AcceptanceStats(k)
    stats.add(greedy, mask, greedy, at)
    # row 0: 0 (emits 4) -> 4 (4) -> 8, 9, 10, 11 (1 each) -> 12 stops; row 1: 2 (1) -> 3 (4)
    assert (stats.decode_emitted, stats.decode_steps) == (12 + 5, 6 + 2)
    assert stats.tau_decode == pytest.approx(17 / 8)
    assert stats.tau_greedy == pytest.approx(sum(1 + r for r in runs) / len(runs))
    assert stats.tau_decode < stats.tau_greedy
    # An unsupervised slot ends a run as a miss does (the answer ends there).
    cut = mask.clone()
    cut[0, 1:] = False
    short = AcceptanceStats(k)
    short.add(greedy, cut, greedy, at)
    assert short.decode_steps == stats.decode_steps + 2  # row 0: 0 (emits 2) -> 2 (4) -> 6, 7..
    plain = AcceptanceStats(k)
    plain.add(greedy, mask, greedy)  # no anchor positions (sampled anchors): no walk
    assert math.isnan(plain.tau_decode)


def test_slots_after_an_unsupervised_one_are_not_supervised():
    valid = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert supervised_prefix(valid).tolist() == [
        [True, True, False, False],
        [True, True, True, True],
    ]
    assert tau_sim(torch.tensor([[1.0, 0.5, 0.5, 0.0]])).item() == pytest.approx(1 + 1 + 0.5 + 0.25)


def _batch(loss_mask: torch.Tensor) -> Batch:
    b, s = loss_mask.shape
    valid = torch.zeros_like(loss_mask)
    valid[:, :-1] = loss_mask[:, 1:]
    return Batch(
        sample_ids=list(range(b)),
        input_ids=torch.zeros(b, s, dtype=torch.int64),
        lengths=torch.full((b,), s),
        aux=torch.zeros(b, s, 1),
        valid=valid,
        labels=torch.zeros(b, s, dtype=torch.int64),
        p_target=torch.zeros(b, s, 1),
    )


def test_anchors_come_only_from_response_positions():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    cand = anchor_candidates(_batch(mask))
    # x_p and x_{p+1} both response tokens
    assert cand[0].nonzero()[:, 0].tolist() == [3, 4, 7]
    gen = torch.Generator().manual_seed(0)
    anchors, ok = pick_anchors(cand, 2, gen)
    assert ok.sum() == 2
    assert set(anchors[ok].tolist()) <= {3, 4, 7}
    assert anchors[ok].tolist() == sorted(anchors[ok].tolist())


def test_anchor_sampling_is_uniform_and_seeded():
    cand = torch.ones(1, 40, dtype=torch.bool)
    draws = [
        pick_anchors(cand, 5, torch.Generator().manual_seed(s))[0][0].tolist() for s in range(200)
    ]
    assert draws[0] == pick_anchors(cand, 5, torch.Generator().manual_seed(0))[0][0].tolist()
    counts = torch.bincount(torch.tensor(draws).flatten(), minlength=40)
    assert counts.min() > 5  # every position gets drawn (expected 25 each)


def test_eagle3_step_j_at_index_i_reads_token_i_plus_j():
    """A chain only sees its own start's context: changing tokens past its step leaves it."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = Eagle3Config(
        layer=SHAPE,
        num_aux=2,
        aux_layers=(0, 1),
        vocab_size=VOCAB,
        draft_vocab_size=20,
        ttt_steps=3,
    )
    model = Eagle3Draft(cfg, embed).eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    aux = torch.randn(1, 16, 2 * SHAPE.hidden_size)
    chains = torch.tensor([[4, 9]])
    with torch.no_grad():
        base = model.forward_ttt(ids, aux, chains)
        ids2 = ids.clone()
        ids2[0, 4 + 3 :] = (ids[0, 4 + 3 :] + 1) % VOCAB  # beyond chain 4's last input (4+2)
        moved = model.forward_ttt(ids2, aux, chains)
    assert base.shape == (2, 3, 20)
    assert torch.allclose(base[0], moved[0], atol=1e-5)
    assert not torch.allclose(base[1], moved[1], atol=1e-3)


def test_draft_vocabulary_keeps_the_most_frequent_and_forced_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3])
    assert build_draft_ids(counts, 3).tolist() == [0, 2, 3]
    assert build_draft_ids(counts, 3, always=[5]).tolist() == [2, 3, 5]
    assert build_draft_ids(counts, None).tolist() == list(range(7))
