"""Importing a speculators DSpark folder whose config.json omits keys: each omitted key means
what speculators' own config says (export.SPECULATORS_DEFAULTS), not what our params default to.
tests/speculators/test_defaults.py checks that table against speculators itself."""

import json

import pytest
import torch
from torch import nn

from dspark import export
from dspark.errors import DataError
from dspark.export import SPECULATORS_DEFAULTS, export_speculators, import_speculators
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.dspark import DSparkConfig, DSparkDraft

from .test_drafts import SHAPE, VOCAB

DRAFT_VOCAB = 20
VERIFIER = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": SHAPE.hidden_size,
    "num_attention_heads": SHAPE.num_heads,
    "num_key_value_heads": SHAPE.num_kv_heads,
    "head_dim": SHAPE.head_dim,
    "intermediate_size": SHAPE.intermediate_size,
    "rms_norm_eps": SHAPE.rms_norm_eps,
    "rope_theta": SHAPE.rope_theta,
    "max_position_embeddings": SHAPE.max_position,
    "vocab_size": VOCAB,
    "num_hidden_layers": 2,
}
# The keys speculators fills in itself, and the config fields they set.
OPTIONAL = {
    "block_size": "block_size",
    "markov_rank": "markov_rank",
    "markov_head_type": "markov_head",
    "enable_confidence_head": "confidence_head",
    "confidence_head_with_markov": "confidence_with_markov",
}


def tiny_config(cls, **arch):
    common = dict(
        layer=SHAPE, num_layers=1, block_size=4, aux_layers=(0, 1), vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB, mask_token_id=VOCAB - 1,
    )  # fmt: skip
    return cls(**{**common, **arch})


def exported(tmp_path, omit, **arch):
    """A tiny draft built as `arch` says, exported, then its config.json stripped of `omit`."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = tiny_config(DSparkConfig, **arch)
    model = DSparkDraft(cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size))
    ids = torch.arange(DRAFT_VOCAB) * 2
    out = tmp_path / "export"
    export_speculators(model, ids, out, verifier_config=VERIFIER, verifier_path="verifier")
    doc = json.loads((out / "config.json").read_text())
    for key in omit:
        del doc[key]
    (out / "config.json").write_text(json.dumps(doc))
    return out, model, embed, ids


def speculators_arch() -> dict:
    return {field: SPECULATORS_DEFAULTS["dspark"][key] for key, field in OPTIONAL.items()}


def test_omitted_keys_take_speculators_defaults(tmp_path):
    omit = [*OPTIONAL, "sample_from_anchor"]
    out, model, embed, ids = exported(tmp_path, omit, **speculators_arch())
    back, back_ids = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert back.cfg == model.cfg
    assert {f: getattr(back.cfg, f) for f in OPTIONAL.values()} == speculators_arch()
    assert torch.equal(back_ids, ids)
    assert export.roundtrip_diff(model, back) == 0.0


def test_an_omitted_key_follows_speculators_even_where_ours_differs(tmp_path, monkeypatch):
    """Were speculators to default the confidence head off while our params default it on,
    a config.json that omits the key describes a draft without one."""
    assert DSparkConfig.__dataclass_fields__["confidence_head"].default is True  # ours
    monkeypatch.setitem(SPECULATORS_DEFAULTS["dspark"], "enable_confidence_head", False)
    arch = {**speculators_arch(), "confidence_head": False}
    out, model, embed, _ = exported(tmp_path, ["enable_confidence_head"], **arch)
    back, _ = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert back.cfg.confidence_head is False and back.confidence_head is None
    assert back.cfg == model.cfg


def test_an_omitted_key_without_a_default_is_one_line(tmp_path):
    out, _, embed, _ = exported(tmp_path, ["mask_token_id"], markov_rank=8)
    with pytest.raises(DataError, match=r"config\.json: malformed speculators config"):
        import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))


def test_a_combination_the_model_refuses_is_a_data_error(tmp_path):
    out, _, embed, _ = exported(tmp_path, [], markov_rank=8)
    doc = json.loads((out / "config.json").read_text())
    doc.update(markov_rank=0, confidence_head_with_markov=True, enable_confidence_head=True)
    (out / "config.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match="confidence_with_markov needs markov_rank > 0"):
        import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))


def test_a_dflash_draft_exports_as_speculators_dflash_and_comes_back(tmp_path):
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = tiny_config(DFlashConfig)
    model = DFlashDraft(cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size))
    for p in model.parameters():  # away from the init, so a lost weight would show
        nn.init.normal_(p, std=0.2)
    ids = torch.arange(DRAFT_VOCAB) * 2
    out = tmp_path / "dflash"
    doc = export_speculators(model, ids, out, verifier_config=VERIFIER, verifier_path="verifier")
    assert doc["speculators_model_type"] == doc["speculators_config"]["algorithm"] == "dflash"
    assert doc["architectures"] == ["DFlashSpeculator"] and doc["sample_from_anchor"] is True
    assert not {k for k in doc if "markov" in k or "confidence" in k}
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    back, back_ids = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert type(back) is DFlashDraft and back.cfg == model.cfg and torch.equal(back_ids, ids)
    assert export.roundtrip_diff(model, back) == 0.0

    # speculators' DFlash default leaves slot 0 out of the draft: the anchor-as-bonus layout
    del doc["sample_from_anchor"]
    (out / "config.json").write_text(json.dumps(doc))
    bonus, _ = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert bonus.cfg.sample_from_anchor is False and bonus.cfg.draft_slots == 3


@pytest.mark.parametrize(
    "levers",
    [
        {"sample_from_anchor": False},
        {"block_attention": "causal"},
        {"feature_input": "first"},
        {"feature_input": "all", "sample_from_anchor": False, "block_attention": "causal"},
    ],
)
@pytest.mark.parametrize("cls", [DSparkConfig, DFlashConfig])
def test_every_lever_exports_and_comes_back_as_it_was(tmp_path, cls, levers):
    """The layout travels in speculators' own field; levers the format has no field for travel
    as extensions under our key, and only when set off their plain value."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = tiny_config(cls, **levers)
    model = (DSparkDraft if cls is DSparkConfig else DFlashDraft)(
        cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size)
    )
    for p in model.parameters():  # feature_fc starts at zero: a lost weight would not show
        nn.init.normal_(p, std=0.2)
    ids = torch.arange(DRAFT_VOCAB) * 2
    out = tmp_path / "export"
    doc = export_speculators(model, ids, out, verifier_config=VERIFIER, verifier_path="verifier")
    assert doc["sample_from_anchor"] is cfg.sample_from_anchor
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (
        cfg.draft_slots
    )
    extensions = (doc.get(export.DSPARK_KEY) or {}).get("extensions", {})
    assert extensions == {k: v for k, v in levers.items() if k in export.EXTENSIONS}
    back, _ = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert back.cfg == model.cfg
    assert export.roundtrip_diff(model, back) == 0.0

    doc[export.DSPARK_KEY] = {"extensions": {"block_shape": "star"}}
    (out / "config.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match="extensions: unknown block_shape"):
        import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))


def test_a_dflash_config_refuses_heads():
    with pytest.raises(ValueError, match="no Markov or confidence head"):
        tiny_config(DFlashConfig, markov_rank=8)
    with pytest.raises(ValueError, match="no Markov or confidence head"):
        tiny_config(DFlashConfig, confidence_head=True)


def vllm_runs_causal(doc: dict) -> bool:
    """vLLM 0.32's reading of a speculators DFlash config.json (its transformers_utils/configs/
    speculators/algos.py, update_dflash): every draft layer is causal unless
    `sliding_window_non_causal` is true, and an omitted key reads as true."""
    return not doc.get("sliding_window_non_causal", True)


@pytest.mark.parametrize("block_attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("cls", [DSparkConfig, DFlashConfig])
def test_vllm_reads_the_blocks_attention_as_trained(tmp_path, cls, block_attention):
    """An export that said `sliding_window_non_causal: false` was served causally by vLLM 0.32
    though our block is bidirectional: its acceptance was our decoder's with the block run causal
    (docs/export.md). speculators reads the field for sliding-window layers only, so true says
    nothing new to it, and the import keeps taking the block's attention from our extensions."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    cfg = tiny_config(cls, block_attention=block_attention)
    model = (DSparkDraft if cls is DSparkConfig else DFlashDraft)(
        cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size)
    )
    out = tmp_path / "export"
    ids = torch.arange(DRAFT_VOCAB) * 2
    doc = export_speculators(model, ids, out, verifier_config=VERIFIER, verifier_path="verifier")
    assert vllm_runs_causal(doc) is (block_attention == "causal")
    assert set(doc["transformer_layer_config"]["layer_types"]) == {"full_attention"}
    back, _ = import_speculators(out, embed, nn.Linear(SHAPE.hidden_size, VOCAB))
    assert back.cfg == model.cfg
