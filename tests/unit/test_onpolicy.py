"""The producers' on-policy decoder: continuously batched greedy answers equal transformers'
greedy generate, and the states it keeps as it decodes equal the extract stage's full forward
over the same tokens, the last token included, whatever order rows end and refill in."""

import pytest
import torch

from dspark.data.shards import TokenSample
from dspark.extract.capture import HiddenStateCapture
from dspark.extract.onpolicy import OnPolicyDecoder
from tests.unit.conftest import NEW

TAPS = (0, 1)  # the tiny target's two layers: an aux layer and the last


def answer_all(llama, varied, prompts, *, rows, max_new=NEW, eos=None, topk=0):
    dec = OnPolicyDecoder(
        llama, varied.eos_token_id if eos is None else eos, 2048, TAPS, rows, 64, max_new, topk
    )
    pending, out = list(enumerate(prompts)), {}
    while pending or dec.busy:
        while pending and dec.free:
            dec.admit(*pending.pop(0))
        for a in dec.step():
            out[a.key] = a
    return [out[i] for i in range(len(prompts))]


def full_forward(varied, answered, topk=0):
    capture = HiddenStateCapture(varied, [0], "float32", topk)
    ids = torch.tensor(answered.input_ids, dtype=torch.int32)
    mask = torch.arange(len(ids)) >= answered.prompt_len
    sample = capture(TokenSample(0, "0", ids, mask))
    capture.close()
    return sample


def test_answers_are_greedy_and_states_are_a_full_forward(llama, varied, prompts, reference):
    """Two rows for three prompts: the third waits for a free row."""
    for p, want, got in zip(
        prompts, reference, answer_all(llama, varied, prompts, rows=2), strict=True
    ):
        assert got.input_ids[: len(p)] == p and got.prompt_len == len(p)
        assert got.input_ids[len(p) :] == want
        full = full_forward(varied, got)
        assert got.feats[0].shape == (len(got.input_ids), varied.model.config.hidden_size)
        assert torch.allclose(got.feats[0], full.aux_hidden[0], atol=1e-4)
        assert torch.allclose(got.feats[1], full.last_hidden, atol=1e-4)


def test_a_row_ends_at_eos_and_keeps_its_states(llama, varied, prompts, reference):
    eos = reference[1][5]
    cut = reference[1].index(eos) + 1
    got = answer_all(llama, varied, prompts, rows=3, eos=eos)[1]
    assert got.input_ids[len(prompts[1]) :] == reference[1][:cut]
    assert torch.allclose(got.feats[1], full_forward(varied, got).last_hidden, atol=1e-4)


def test_one_new_token_still_gets_its_states(llama, varied, prompts, reference):
    got = answer_all(llama, varied, prompts, rows=1, max_new=1)
    for p, want, a in zip(prompts, reference, got, strict=True):
        assert a.input_ids == p + want[:1]
        assert a.feats[0].shape[0] == len(p) + 1
        assert torch.allclose(a.feats[1], full_forward(varied, a).last_hidden, atol=1e-4)


def test_a_prompt_too_long_for_a_row_is_refused(llama, varied):
    dec = OnPolicyDecoder(llama, varied.eos_token_id, 2048, TAPS, 1, 8, 4)
    with pytest.raises(ValueError, match="9 tokens"):
        dec.admit("x", list(range(10, 19)))
    with pytest.raises(ValueError, match="exceeds the target's 2048 positions"):
        OnPolicyDecoder(llama, varied.eos_token_id, 2048, TAPS, 1, 2000, 100)


def test_a_dropped_row_frees_for_the_next_prompt(llama, varied, prompts, reference):
    """Work nobody will take (its consumer restarted) leaves its row; the rest is unchanged."""
    dec = OnPolicyDecoder(llama, varied.eos_token_id, 2048, TAPS, 2, 64, NEW)
    dec.admit(0, prompts[0])
    dec.admit(1, prompts[1])
    dec.step()
    assert dec.drop(lambda key: key != 0) == 1 and dec.free == [0]
    dec.admit(2, prompts[2])
    out = {}
    while dec.busy:
        out.update((a.key, a) for a in dec.step())
    assert sorted(out) == [1, 2]
    for i in (1, 2):
        assert out[i].input_ids[len(prompts[i]) :] == reference[i]


@pytest.mark.parametrize("rows", [1, 2])
def test_top_k_kept_while_decoding_is_the_full_forwards(llama, varied, prompts, reference, rows):
    """The top-k log-probabilities taken from the decode's own logits, one per supervised
    position (prompt_len - 1 onwards), equal those of the extract stage's full forward over the
    same tokens, to float noise between a batched step and one forward (stated: 1e-4)."""
    eos = reference[1][5]  # row 1 ends early at EOS, so rows end and refill out of step
    for a in answer_all(llama, varied, prompts, rows=rows, eos=eos, topk=5):
        full = full_forward(varied, a, topk=5)
        values, ids = a.target_topk
        assert (
            values.shape == (len(a.input_ids) - a.prompt_len, 5) and values.dtype == torch.float32
        )
        torch.testing.assert_close(values, full.target_logprobs, rtol=0, atol=1e-4)
        assert torch.equal(ids, full.target_ids)
        # the kept argmax is the token the decoder chose next
        assert ids[:, 0].tolist() == a.input_ids[a.prompt_len :]


@pytest.mark.parametrize("topk", [0, 5])
def test_a_prompts_answer_and_states_do_not_depend_on_its_batch(llama, varied, prompts, topk):
    """Row-invariant decoding: each prompt alone, all together, two rows refilling, and in the
    reverse order give the same tokens and bit-identical states and top-k, which is what lets
    two extractions agree however their producers were scheduled."""
    runs = [
        answer_all(llama, varied, prompts, rows=1, topk=topk),
        answer_all(llama, varied, prompts, rows=len(prompts), topk=topk),
        answer_all(llama, varied, prompts, rows=2, topk=topk),
        answer_all(llama, varied, prompts[::-1], rows=2, topk=topk)[::-1],
    ]
    first = runs[0]
    for other in runs[1:]:
        for a, b in zip(first, other, strict=True):
            assert a.input_ids == b.input_ids
            assert all(torch.equal(a.feats[i], b.feats[i]) for i in TAPS)
            if topk:
                assert all(
                    torch.equal(x, y) for x, y in zip(a.target_topk, b.target_topk, strict=True)
                )
    assert llama.row_invariant is False  # the caller's Llama keeps its own setting
