"""Our Llama forward against transformers' on the tiny target: prefill, ragged verification
steps with padding, rewritten (rejected) positions, and tapped hidden states."""

import pytest
import torch

from dspark.decode.llama import Llama
from dspark.models.layers import gqa_attention


def reference(tiny_target, ids):
    with torch.no_grad():
        out = tiny_target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.logits, out.hidden_states


def test_prefill_matches_transformers(tiny_target):
    model = Llama.from_hf(tiny_target.model)
    ids = torch.randint(
        0, tiny_target.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0)
    )
    want, hidden = reference(tiny_target, ids)
    cache = model.new_cache(3, 64)
    got, taps = model(ids, torch.arange(20).expand(3, 20), cache, taps=(0, 1))
    assert (got - want).abs().max().item() < 1e-4
    assert (taps[0] - hidden[1]).abs().max().item() < 1e-4  # output of decoder layer 0


def test_ragged_steps_with_padding_and_rewrites_match_transformers(tiny_target):
    model = Llama.from_hf(tiny_target.model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_target.vocab_size, (3, 24), generator=gen)
    want, _ = reference(tiny_target, ids)
    cache = model.new_cache(3, 32)
    lengths = [10, 7, 12]  # each row's prefill, padded to 12
    pos = torch.arange(12).expand(3, 12)
    valid = pos < torch.tensor(lengths)[:, None]
    model(torch.where(valid, ids[:, :12], 0), pos, cache, valid)
    # A verification step writes junk at the next positions (drafts that get rejected) ...
    junk = torch.randint(0, tiny_target.vocab_size, (3, 4), generator=gen)
    step_pos = torch.tensor(lengths)[:, None] + torch.arange(4)
    model(junk, step_pos, cache)
    # ... then each row continues with its true tokens, a different count per row.
    take = [5, 2, 4]
    t = max(take)
    step_pos = torch.tensor(lengths)[:, None] + torch.arange(t)
    step_valid = torch.arange(t)[None] < torch.tensor(take)[:, None]
    tokens = ids.gather(1, step_pos.clamp_max(23))
    got, _ = model(torch.where(step_valid, tokens, 0), step_pos, cache, step_valid)
    for r in range(3):
        for j in range(take[r]):
            p = lengths[r] + j
            diff = (got[r, j] - want[r, p]).abs().max().item()
            assert diff < 1e-4, (r, j, diff)


def test_causal_kernel_equals_the_explicit_causal_mask():
    """A prefill from position 0 takes SDPA's causal kernel (mask None); it must attend exactly
    as the explicit lower-triangular mask does, grouped heads included."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 17, 8, generator=gen)  # 6 query heads over 2 kv heads
    k, v = torch.randn(2, 2, 17, 8, generator=gen), torch.randn(2, 2, 17, 8, generator=gen)
    tril = torch.ones(17, 17, dtype=torch.bool).tril()
    want = gqa_attention(q, k, v, tril)
    assert (gqa_attention(q, k, v, None) - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="as many keys as queries"):
        gqa_attention(q[:, :, :5], k, v, None)


@pytest.mark.parametrize("lengths", [[10, 3, 16, 7], [5, 5, 5]])
def test_a_ragged_prefill_attends_row_by_row_as_the_explicit_mask_does(tiny_target, lengths):
    """Rows of different lengths from position 0 take the causal kernel row by row; logits at
    each row's last token, every tapped state and the cache equal the one explicit mask's,
    and each row's logits equal its prefill alone."""
    model = Llama.from_hf(tiny_target.model)
    gen = torch.Generator().manual_seed(3)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(0, tiny_target.vocab_size, (b, t), generator=gen)
    pos = torch.arange(t).expand(b, t)
    valid = pos < torch.tensor(lengths)[:, None]
    last = (torch.tensor(lengths) - 1)[:, None]
    got: dict[bool, tuple] = {}
    for ragged in (True, False):
        model.ragged_causal = ragged
        cache = model.new_cache(b, t + 4)
        logits, taps = model(ids, pos, cache, valid, taps=(0, 1), logits_at=last)
        got[ragged] = (logits, taps, cache)
    (lr, tr, cr), (lm, tm, cm) = got[True], got[False]
    assert (lr - lm).abs().max().item() < 1e-5
    for i in (0, 1):
        assert ((tr[i] - tm[i]).abs() * valid[..., None]).max().item() < 1e-5
    for r, n in enumerate(lengths):  # the cache a decode reads next: every row's n positions
        assert (cr.k[:, r, :, :n] - cm.k[:, r, :, :n]).abs().max().item() < 1e-5
        assert (cr.v[:, r, :, :n] - cm.v[:, r, :, :n]).abs().max().item() < 1e-5
        alone, _ = model(ids[r : r + 1, :n], pos[:1, :n], model.new_cache(1, n + 1))
        assert (alone[0, -1] - lr[r, 0]).abs().max().item() < 1e-4


def test_the_fused_pieces_give_the_same_bits_as_the_plain_ones():
    """The decoder's fast path changes no bit: torch's fused RMSNorm equals the drafts' op-by-op
    module, and a one-token step that attends without a mask equals the explicit all-true
    mask."""
    from dspark.decode.llama import _grouped_attention, rms_norm
    from dspark.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        for rows in (1, 3, 40):
            x = torch.randn(2, rows, 64, generator=gen) * 3
            assert torch.equal(rms_norm(x, norm.weight, norm.eps), norm(x))
    q = torch.randn(2, 6, 1, 8, generator=gen)  # 6 query heads over 2 kv heads, one token
    k, v = torch.randn(2, 2, 37, 8, generator=gen), torch.randn(2, 2, 37, 8, generator=gen)
    everything = torch.ones(2, 1, 3, 37, dtype=torch.bool)
    assert torch.equal(_grouped_attention(q, k, v, None), _grouped_attention(q, k, v, everything))
    assert torch.equal(
        _grouped_attention(q, k, v, None), gqa_attention(q, k, v, everything[0, 0, :1])
    )


def test_a_weight_the_decoder_lacks_is_refused_by_name(tiny_target):
    """A Llama variant with, say, attention biases would otherwise lose them silently."""
    state = dict(tiny_target.model.state_dict())
    state["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(1)
    model = Llama.from_hf(tiny_target.model)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.bias: not a weight"
    ):
        model.layers[1].load_hf(state, "model.layers.1.")
