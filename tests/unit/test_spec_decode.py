"""Speculative decoding on the tiny target: greedy output equals the target's own, whatever the
drafts (random, perfect, DSpark, EAGLE-3, n-gram), in ragged batches; the drafts decode exactly
as they were trained; rejection sampling keeps the target's distribution; tau is counted right."""

import numpy as np
import pytest
import torch
from torch import nn

from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.llama import Llama
from dspark.decode.proposers import NgramProposer, NoProposer, Proposal, Proposer
from dspark.decode.sampling import Sampling, verify_sampled, warp
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.models.layers import LayerShape
from tests.unit.conftest import NEW

DRAFT_VOCAB = 256


def decoder(llama, varied, proposer):
    return SpecDecoder(llama, proposer, varied.eos_token_id, max_context=2048)


class Oracle(Proposer):
    """Drafts the reference continuation: every draft is right."""

    name, k = "oracle", 5

    def __init__(self, prompts, reference):
        self.full = [p + r + [0] * 8 for p, r in zip(prompts, reference, strict=True)]

    def propose(self, seq, n, active, sampling, gen, rows=slice(None)):
        tokens = torch.tensor(
            [self.full[i][int(n[i]) + 1 : int(n[i]) + 1 + self.k] for i in range(len(self.full))]
        )
        return Proposal(tokens, torch.full((len(self.full),), self.k))


class Random(Proposer):
    """Random drafts, a ragged count per row, sometimes right by borrowing the oracle's."""

    name, k = "random", 4

    def __init__(self, oracle: Oracle, vocab: int):
        self.oracle, self.vocab = oracle, vocab
        self.gen = torch.Generator().manual_seed(3)

    def propose(self, seq, n, active, sampling, gen, rows=slice(None)):
        b = seq.shape[0]
        right = self.oracle.propose(seq, n, active, sampling, gen).tokens[:, : self.k]
        noise = torch.randint(0, self.vocab, right.shape, generator=self.gen)
        keep = torch.rand(right.shape, generator=self.gen) < 0.6
        k_row = torch.randint(0, self.k + 1, (b,), generator=self.gen)
        return Proposal(torch.where(keep, right, noise), k_row)


def tiny_drafts(varied, block=4, **levers):
    """DSpark (its block built as `levers` say: DSparkConfig's study options) and EAGLE-3."""
    cfg = varied.model.config.to_dict()
    shape = LayerShape.from_hf(cfg)
    torch.manual_seed(0)
    draft_ids = torch.randperm(varied.vocab_size)[:DRAFT_VOCAB].sort().values
    rows = varied.lm_head.weight[draft_ids].detach()
    common = dict(
        layer=shape, aux_layers=(0, 1), vocab_size=varied.vocab_size,
        draft_vocab_size=DRAFT_VOCAB,
    )  # fmt: skip
    dspark = DSparkDraft(
        DSparkConfig(
            num_layers=2, block_size=block, mask_token_id=0, markov_rank=16, **common, **levers
        ),
        varied.embed,
        rows,
    )
    eagle = Eagle3Draft(Eagle3Config(num_aux=2, ttt_steps=block, **common), varied.embed)
    eagle.init_from_target(varied.norm, varied.lm_head, draft_ids)
    for model in (dspark, eagle):
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" not in name:
                nn.init.normal_(p, std=0.05)
    return (dspark, draft_ids), (eagle, draft_ids)


def tiny_dflash(varied, block=4, **levers):
    """A DFlash draft over the same draft vocabulary as tiny_drafts' (same seed)."""
    cfg = varied.model.config.to_dict()
    torch.manual_seed(0)
    draft_ids = torch.randperm(varied.vocab_size)[:DRAFT_VOCAB].sort().values
    cfg = DFlashConfig(
        layer=LayerShape.from_hf(cfg),
        num_layers=2,
        block_size=block,
        aux_layers=(0, 1),
        vocab_size=varied.vocab_size,
        draft_vocab_size=DRAFT_VOCAB,
        mask_token_id=0,
        **levers,
    )
    model = DFlashDraft(cfg, varied.embed, varied.lm_head.weight[draft_ids].detach())
    for name, p in model.named_parameters():
        if p.requires_grad and "norm" not in name:
            nn.init.normal_(p, std=0.05)
    return model, draft_ids


def trained_drafts(varied) -> dict:
    """{draft kind: (model, draft_ids)} for every kind, as a drafts folder holds them."""
    (dspark, ids), (eagle, _) = tiny_drafts(varied)
    return {"dspark": (dspark, ids), "eagle3": (eagle, ids), "dflash": tiny_dflash(varied)}


def save_trained_drafts(varied, folder):
    """A drafts folder as the train stage writes it, one subfolder per kind -> `folder`."""
    from dspark.io import atomic_dir
    from dspark.train.checkpoint import save_draft

    for name, (model, ids) in trained_drafts(varied).items():
        with atomic_dir(folder / name) as tmp:
            save_draft(tmp, model, ids, {})
    return folder


def test_plain_decoding_equals_transformers_generate(llama, varied, prompts, reference):
    traces, _ = decoder(llama, varied, NoProposer()).generate(prompts, NEW)
    assert [t.tokens for t in traces] == reference
    assert all(a == 0 for t in traces for a in t.accepted)


def test_perfect_drafts_are_all_accepted(llama, varied, prompts, reference):
    oracle = Oracle(prompts, reference)
    traces, _ = decoder(llama, varied, oracle).generate(prompts, NEW)
    assert [t.tokens for t in traces] == reference
    for t in traces:
        # Every step but the last accepts all 5 drafts and emits 6 tokens.
        assert t.accepted[:-1] == [5] * (t.steps - 1)
        assert sum(t.emitted) == len(t.tokens) - 1  # the prefill's token is apart


def test_random_ragged_drafts_keep_greedy_output(llama, varied, prompts, reference):
    proposer = Random(Oracle(prompts, reference), varied.vocab_size)
    traces, timing = decoder(llama, varied, proposer).generate(prompts, NEW)
    assert [t.tokens for t in traces] == reference
    assert any(0 < a < p for t in traces for a, p in zip(t.accepted, t.proposed, strict=True))
    assert timing.verify_s > 0


@pytest.mark.parametrize("which", ["dspark", "eagle3", "dflash"])
def test_trained_drafts_keep_greedy_output(which, llama, varied, prompts, reference):
    kind = {"dspark": DSparkProposer, "eagle3": Eagle3Proposer, "dflash": DFlashProposer}[which]
    proposer = kind(*trained_drafts(varied)[which])
    traces, _ = decoder(llama, varied, proposer).generate(prompts, NEW)
    assert [t.tokens for t in traces] == reference
    if which == "dspark":
        assert all(len(c) == 4 and all(0 < x < 1 for x in c) for t in traces for c in t.confidence)
    if which == "dflash":  # no confidence head: nothing to report
        assert not any(t.confidence for t in traces)


def _prefill(llama, varied, prompt, proposer):
    """The anchor at the prompt's end with the prompt's features in the proposer's cache, and
    the target features [1, S, 2H] of the prompt for the training forwards."""
    n = len(prompt) - 1
    seq = torch.tensor([prompt + [0] * 8])
    cache = llama.new_cache(1, len(prompt) + 8)
    _, taps = llama(seq[:, :n], torch.arange(n)[None], cache, taps=(0, 1))
    proposer.start(1, len(prompt) + 8)
    proposer.extend(seq, torch.tensor([0]), torch.tensor([n]), taps)
    return seq, torch.tensor([n]), torch.cat((taps[0], taps[1]), -1)


def test_dspark_decodes_as_it_trains(llama, varied, prompts):
    (model, draft_ids), _ = tiny_drafts(varied)
    proposer = DSparkProposer(model, draft_ids)
    seq, n, aux = _prefill(llama, varied, prompts[1], proposer)
    drafted = proposer.propose(seq, n, torch.tensor([True]), Sampling(), None)
    # Teacher-forced on its own picks, the training forward gives the same logits' argmax.
    ids = torch.cat((seq[:, : int(n) + 1], drafted.tokens), 1)
    aux = torch.cat((aux, aux.new_zeros(1, ids.shape[1] - aux.shape[1], aux.shape[2])), 1)
    logits, conf = model.forward_train(ids, aux, n[None])
    assert draft_ids[logits[0].argmax(-1)].tolist() == drafted.tokens[0].tolist()
    assert torch.allclose(torch.sigmoid(conf[0]), drafted.confidence[0], atol=1e-5)


def test_eagle3_decodes_as_it_trains(llama, varied, prompts):
    _, (model, draft_ids) = tiny_drafts(varied)
    proposer = Eagle3Proposer(model, draft_ids)
    seq, n, aux = _prefill(llama, varied, prompts[1], proposer)
    drafted = proposer.propose(seq, n, torch.tensor([True]), Sampling(), None)
    ids = torch.cat((seq[:, : int(n) + 1], drafted.tokens), 1)
    aux = torch.cat((aux, aux.new_zeros(1, ids.shape[1] - aux.shape[1], aux.shape[2])), 1)
    logits = model.forward_ttt(ids, aux, n[None])
    assert draft_ids[logits[0].argmax(-1)].tolist() == drafted.tokens[0].tolist()


def test_rejection_sampling_keeps_the_target_distribution():
    """Vocabulary of 6, two drafts drawn from q; the target is position-wise independent, so
    the first token must follow p0, and the second (once the first is accepted) p1."""
    gen = torch.Generator().manual_seed(0)
    v, rows = 6, 200_000
    p = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, v, generator=gen) * 1.5, -1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=gen).T  # [rows, 2]
    verdict = verify_sampled(
        drafts,
        q.expand(rows, 2, v),
        p.expand(rows, 3, v),
        torch.full((rows,), 2),
        gen,
    )
    a = verdict.accepted
    first = torch.where(a == 0, verdict.next_token, drafts[:, 0])
    freq = torch.bincount(first, minlength=v) / rows
    assert (freq - p[0]).abs().max() < 0.006
    go_on = a >= 1
    second = torch.where(a[go_on] == 1, verdict.next_token[go_on], drafts[go_on, 1])
    freq = torch.bincount(second, minlength=v) / go_on.sum()
    assert (freq - p[1]).abs().max() < 0.008
    all_in = a == 2
    freq = torch.bincount(verdict.next_token[all_in], minlength=v) / all_in.sum()
    assert (freq - p[2]).abs().max() < 0.015  # the bonus


def test_warp_applies_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(warp(logits, Sampling(1.0, 1.0)), torch.exp(logits))
    nucleus = warp(logits, Sampling(1.0, 0.75))  # 0.5 + 0.3 reaches 0.75: two tokens kept
    assert torch.allclose(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    cold = warp(logits, Sampling(0.5, 1.0))
    assert cold[0, 0] > 0.5 and torch.allclose(cold.sum(), torch.tensor(1.0))


def test_sampled_decoding_runs_for_every_proposer(llama, varied, prompts, reference):
    dspark, eagle = tiny_drafts(varied)
    for proposer in (
        NoProposer(),
        NgramProposer(4, 1, 3, varied.vocab_size),
        DSparkProposer(*dspark),
        Eagle3Proposer(*eagle),
    ):
        traces, _ = decoder(llama, varied, proposer).generate(
            prompts, NEW, Sampling(0.7, 0.9), seed=1
        )
        assert all(0 < len(t.tokens) <= NEW for t in traces)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ng = NgramProposer(k=3, min_n=1, max_n=3)
    tokens = np.array([5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7])
    # suffix [8, 6, 7] never occurred; [6, 7] last occurred at index 6 -> then 3, 4, 8
    assert ng.lookup(tokens).tolist() == [3, 4, 8]
    assert NgramProposer(k=3, min_n=3, max_n=3).lookup(tokens).tolist() == []
    assert ng.lookup(np.array([1, 2, 3, 1, 2])).tolist() == [3, 1, 2]
    assert ng.lookup(np.array([4])).tolist() == []  # nothing earlier to match
    with pytest.raises(ValueError, match="ngram window"):
        NgramProposer(k=3, min_n=4, max_n=2)


def test_ngram_decoding_keeps_greedy_output(tiny_target):
    # The session's tiny target repeats itself, so lookups hit.
    flat = Llama.from_hf(tiny_target.model)
    prompt = [11, 12, 13, 14, 15] * 6
    ref = decoder(flat, tiny_target, NoProposer()).generate([prompt], NEW)[0][0]
    traces, _ = decoder(flat, tiny_target, NgramProposer(4, 1, 3)).generate([prompt], NEW)
    assert traces[0].tokens == ref.tokens
    assert max(traces[0].proposed) > 0


def test_tau_counts_emitted_tokens_and_stops_at_eos(llama, varied, prompts, reference):
    oracle = Oracle(prompts[:1], reference[:1])
    eos = reference[0][7]  # pretend this token is EOS: row 0 stops right after it
    assert eos not in reference[0][:7]
    dec = SpecDecoder(llama, oracle, eos, max_context=2048)
    traces, _ = dec.generate(prompts[:1], NEW)
    assert traces[0].tokens == reference[0][:8]
    # prefill gives token 0; step 1 emits 1..6 (5 accepted + bonus); step 2 emits 7 then stops
    assert traces[0].emitted == [6, 1]


def test_prompts_at_the_context_limit(llama, varied):
    dec = SpecDecoder(llama, NgramProposer(4), varied.eos_token_id, max_context=64)
    fits = [7] * (64 - 8 - 4 + 1)  # the last verify step reaches position 63 exactly
    traces, _ = dec.generate([fits], 8)
    assert 0 < len(traces[0].tokens) <= 8
    with pytest.raises(ValueError, match="exceeds the target's 64 positions"):
        dec.generate([[*fits, 7]], 8)
