"""evals.slot_attention on a tiny block draft: the weights it inspects are the ones the forward
uses, its buckets share out each slot's whole attention, and uniform attention lands in them in
proportion to their size."""

import pytest
import torch

from dspark.models.dspark import block_mask
from dspark.models.layers import rope_cos_sin
from dspark.schema import Sample
from evals.slot_attention import BUCKETS, FIRST_ANCHOR, main, slot_attention
from tests.unit.test_spec_decode import tiny_drafts


@pytest.fixture(scope="module")
def draft(varied):
    (model, _), _ = tiny_drafts(varied)  # 2 layers, block 4
    return model.eval()


def samples(varied, lengths=((6, 30), (12, 25))) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    h = varied.model.config.hidden_size
    out = []
    for i, (prompt, n) in enumerate(lengths):
        ids = torch.randint(1, varied.vocab_size, (n,), generator=gen).to(torch.int32)
        mask = torch.arange(n) >= prompt
        aux = torch.randn(2, n, h, generator=gen)
        out.append(Sample(i, ids, mask, aux, aux[-1]))
    return out


def test_the_inspected_logits_are_the_forwards(draft, varied):
    x = samples(varied)[0]
    s = x.num_tokens
    anchors = torch.tensor([[9, 14, 20]])
    ctx = draft.context(x.aux_hidden.permute(1, 0, 2).reshape(1, s, -1))
    weights: list[torch.Tensor] = []
    with torch.no_grad():
        plain = draft.backbone(ctx, x.input_ids.long()[anchors], anchors)
        seen = draft.backbone(ctx, x.input_ids.long()[anchors], anchors, attention=weights)
        assert torch.equal(plain, seen)  # inspecting changes nothing
        # Layer 0 rebuilt from its weights: probs @ values through o_proj is its attention out.
        attn, sh = draft.layers[0].self_attn, draft.cfg.layer
        block = draft.embed(torch.full((1, 12), draft.cfg.mask_token_id))
        block[0, ::4] = draft.embed(x.input_ids.long()[anchors[0]])
        normed = draft.layers[0].input_layernorm(block)
        rope = _rope(anchors, draft)
        ctx_k, ctx_v = attn.context_kv(ctx, _rope(torch.arange(s)[None], draft, block=1))
        v = torch.cat((ctx_v, attn.context_kv(normed, rope)[1]), dim=2)
        v = v.repeat_interleave(sh.num_heads // sh.num_kv_heads, dim=1)
        mixed = (weights[0].softmax(-1) @ v).transpose(1, 2).reshape(1, 12, -1)
        mask = block_mask(anchors, 4, s)
        torch.testing.assert_close(
            attn.o_proj(mixed), attn(normed, ctx_k, ctx_v, rope, mask), atol=1e-5, rtol=1e-4
        )
    assert len(weights) == draft.cfg.num_layers


def _rope(positions, draft, block=4):
    """cos, sin at `block` positions from each of `positions` [1, N] (as backbone lays out)."""
    sh = draft.cfg.layer
    pos = (positions[:, :, None] + torch.arange(block)).reshape(positions.shape[0], -1)
    return rope_cos_sin(pos, sh.head_dim, sh.rope_theta)


def test_the_buckets_share_out_every_slots_attention(draft, varied):
    found = slot_attention(draft, samples(varied), anchors_per_sample=8)
    assert found["anchors"] == 8 + 8  # anchors from max(prompt, 9), 8 a sample
    for layer in found["layers"]:
        for row in layer["mass"]:
            assert len(row) == len(BUCKETS) and sum(row) == pytest.approx(1.0, abs=1e-3)
        for row, by_head in zip(layer["mass"], layer["head_p1"], strict=True):
            assert len(by_head) == draft.cfg.layer.num_heads
            assert sum(by_head) / len(by_head) == pytest.approx(row[0], abs=1e-3)  # the mean


def test_uniform_attention_lands_in_proportion(draft, varied):
    flat = type(draft)(draft.cfg, draft.embed, draft.lm_head.weight.detach())
    flat.load_state_dict(draft.state_dict())
    for layer in flat.layers:
        torch.nn.init.zeros_(layer.self_attn.q_proj.weight)  # every score 0: uniform weights
    xs = samples(varied, lengths=((3, 20),))
    found = slot_attention(flat.eval(), xs, anchors_per_sample=100)
    p = torch.arange(FIRST_ANCHOR, 19, dtype=torch.float64)
    k = flat.cfg.block_size
    seen = p + k  # context before the anchor and the block
    expect = [1 / seen, 1 / seen, 1 / seen, 5 / seen, (p - 8) / seen, k / seen]
    for layer in found["layers"]:
        for row, by_head in zip(layer["mass"], layer["head_p1"], strict=True):
            for got, want in zip(row, expect, strict=True):
                assert got == pytest.approx(float(want.mean()), abs=1e-4)
            assert by_head == pytest.approx([float(expect[0].mean())] * len(by_head), abs=1e-4)
        zeros = [[0.0] * flat.cfg.layer.num_heads] * k
        assert layer["logit_p1"] == zeros and layer["logit_rival"] == zeros


def test_the_gains_scale_every_logit_by_their_product(draft, varied):
    """q_norm and k_norm end the query's and the key's paths, so their gains multiply each
    logit (and the layer's logit scale) and leave where a head points unchanged."""
    sharp = type(draft)(draft.cfg, draft.embed, draft.lm_head.weight.detach())
    sharp.load_state_dict(draft.state_dict())
    with torch.no_grad():
        for layer in sharp.layers:
            layer.self_attn.q_norm.weight.mul_(2.0)
            layer.self_attn.k_norm.weight.mul_(1.5)
    xs = samples(varied)
    base = slot_attention(draft, xs, anchors_per_sample=8)["layers"][0]
    found = slot_attention(sharp.eval(), xs, anchors_per_sample=8)["layers"][0]
    assert found["logit_scale"] == pytest.approx(3.0 * base["logit_scale"], rel=1e-3)
    for key in ("logit_p1", "logit_rival"):
        got, want = torch.tensor(found[key]), 3.0 * torch.tensor(base[key])
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert torch.tensor(base["logit_rival"]).abs().sum() > 0  # a random draft's are not 0


def test_a_workspace_without_drafts_is_one_line(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("profile: default\n")
    assert main(["--root", str(tmp_path), "--drafts", "dspark"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "dspark" in err
