"""Playback of a recorded greedy decode gives every proposer the same steps as decoding live:
the same drafts accepted, the same tokens, on a ragged batch of the tiny target; the recording's
features are a full forward's; a draft that proposes the target's own continuation reaches
tau = k + 1 through it; and a path is checked against transformers teacher-forced."""

import pytest
import torch

from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.proposers import NgramProposer, NoProposer
from dspark.decode.reference import Reference
from dspark.decode.replay import Playback, decode_recorded
from tests.unit.conftest import NEW
from tests.unit.test_spec_decode import Oracle, Random, tiny_dflash, tiny_drafts


def proposers(varied, prompts, reference):
    """name -> a fresh proposer (a new one for each decode: some keep state)."""
    return {
        "none": lambda: NoProposer(),
        "oracle": lambda: Oracle(prompts, reference),
        "random": lambda: Random(Oracle(prompts, reference), varied.vocab_size),
        "ngram": lambda: NgramProposer(4, 1, 3),
        "dspark": lambda: DSparkProposer(*tiny_drafts(varied)[0]),
        "eagle3": lambda: Eagle3Proposer(*tiny_drafts(varied)[1]),
        "dflash": lambda: DFlashProposer(*tiny_dflash(varied)),
    }


def recorded(llama, varied, prompts, k, taps=(0, 1)):
    return decode_recorded(
        llama, varied.eos_token_id, 2048, prompts, NEW, taps, reach=max(k - 1, 0)
    )


def replayed(llama, varied, prompts, proposer):
    _, _, rec = recorded(llama, varied, prompts, proposer.k)
    dec = SpecDecoder(Playback(rec, varied.vocab_size), proposer, varied.eos_token_id, 2048)
    return dec.generate(prompts, NEW)[0]


@pytest.mark.parametrize(
    "name", ["none", "oracle", "random", "ngram", "dspark", "eagle3", "dflash"]
)
def test_playback_decodes_as_the_target_does(name, llama, varied, prompts, reference):
    make = proposers(varied, prompts, reference)[name]
    live, _ = SpecDecoder(llama, make(), varied.eos_token_id, 2048).generate(prompts, NEW)
    played = replayed(llama, varied, prompts, make())
    for a, b in zip(live, played, strict=True):
        assert (a.tokens, a.accepted, a.proposed, a.emitted) == (
            b.tokens,
            b.accepted,
            b.proposed,
            b.emitted,
        )
        flat = [c for step in b.confidence for c in step]
        assert [c for step in a.confidence for c in step] == pytest.approx(flat, abs=1e-4)
    if name == "random":  # the case that matters: partial acceptance, ragged drafts
        assert any(0 < a < p for t in played for a, p in zip(t.accepted, t.proposed, strict=True))


def test_the_targets_own_continuation_reaches_k_plus_one(llama, varied, prompts, reference):
    oracle = Oracle(prompts, reference)
    for t in replayed(llama, varied, prompts, oracle):
        full = t.emitted[:-1]  # the last step is cut by the cap
        assert full and all(e == oracle.k + 1 for e in full)


def test_the_recording_is_transformers_path_with_a_full_forwards_features(
    llama, varied, prompts, reference
):
    """Features captured step by step while decoding equal one forward over the whole path
    (to 1e-4), and past the end the recording goes on greedily."""
    traces, _, rec = recorded(llama, varied, prompts, k=4, taps=(0, 1))
    assert [t.tokens for t in traces] == reference
    for i, (p, r) in enumerate(zip(prompts, reference, strict=True)):
        n = int(rec.lens[i])
        assert n == len(p) + len(r) + 3  # reach k - 1 = 3
        full = torch.tensor([p + r])[:, : len(p) + len(r)]
        whole = full.shape[1]
        cache = llama.new_cache(1, n + 4)
        logits, taps = llama(full, torch.arange(whole)[None], cache, taps=(0, 1))
        for layer in (0, 1):
            got = rec.feats[layer][i, :whole]
            assert torch.allclose(got, taps[layer][0], atol=1e-4), layer
        # the choice after position j is token j + 1 of the path, and past it the argmax
        assert rec.next_token[i, len(p) - 1 : whole - 1].tolist() == r
        assert int(rec.next_token[i, whole - 1]) == int(logits[0, -1].argmax())


def test_a_path_is_checked_against_transformers_teacher_forced(varied, prompts, reference):
    ref = Reference(varied)
    assert ref.check_batch(prompts, reference) == [[], [], []]
    swapped = [list(r) for r in reference]
    swapped[1][5] = (swapped[1][5] + 1) % varied.vocab_size
    differ = ref.check_batch(prompts, swapped)
    assert differ[0] == [] and differ[2] == []
    assert differ[1][0][0] == 5 and differ[1][0][1] > 0  # the swap, with its margin


def test_playback_refuses_a_position_it_did_not_record(llama, varied, prompts):
    _, _, rec = recorded(llama, varied, prompts, k=0, taps=())
    play = Playback(rec, varied.vocab_size)
    positions = rec.lens[:, None].clone()
    with pytest.raises(ValueError, match="row 0 asked about position"):
        play(torch.zeros_like(positions), positions, play.new_cache(3, 8))


def test_recorded_states_are_the_extract_stages_capture(llama, varied, prompts):
    """Issue 20's tolerance: states kept while decoding are those the extract stage captures
    with transformers on the same tokens (float32, to 1e-4), so on-policy data can come from
    decoding alone."""
    from dspark.data.shards import TokenSample
    from dspark.extract.capture import HiddenStateCapture

    traces, _, rec = recorded(llama, varied, prompts, k=1, taps=(0, 1))
    capture = HiddenStateCapture(varied, [0, 1], "float32")
    for i, (p, t) in enumerate(zip(prompts, traces, strict=True)):
        ids = torch.tensor(p + t.tokens, dtype=torch.int32)
        full = capture(TokenSample(i, str(i), ids, torch.arange(len(ids)) >= len(p)))
        for j, layer in enumerate((0, 1)):
            got = rec.feats[layer][i, : len(ids)]
            assert torch.allclose(got, full.aux_hidden[j], atol=1e-4), (i, layer)
    capture.close()
