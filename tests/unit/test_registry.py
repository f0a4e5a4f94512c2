"""The one registry of draft kinds and proposer methods (dspark.drafts): every method builds,
every kind round-trips through a checkpoint, names are owned once, bad input is one line."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from dspark.config import (
    DRAFT_NAMES,
    MARKOV_ABLATION,
    HybridConfig,
    benchmark_modes,
    methods,
    serving_modes,
)
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.hybrid import HybridProposer
from dspark.decode.proposers import NgramProposer, NoProposer
from dspark.drafts import (
    DRAFT_KINDS,
    METHODS,
    DraftKind,
    ProposerContext,
    Registry,
    UnknownName,
    build_proposer,
    load_draft,
    read_draft_config,
    register_draft,
    trained_proposer,
)
from dspark.errors import ConfigError, DataError
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.train.checkpoint import save_draft
from dspark.train.recipes import dspark_recipes

from .test_drafts import SHAPE, VOCAB

ROOT = Path(__file__).resolve().parents[2]
DRAFT_VOCAB = 20


@dataclass
class FakeTarget:
    """What a proposer builder reads of the target."""

    embed: nn.Embedding
    vocab_size: int = VOCAB


def tiny_draft(kind: str, embed: nn.Embedding) -> nn.Module:
    torch.manual_seed(0)
    common = dict(
        layer=SHAPE, aux_layers=(0, 1), vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB
    )  # fmt: skip
    if kind == "dspark":
        cfg = DSparkConfig(
            num_layers=1, block_size=4, mask_token_id=VOCAB - 1, markov_rank=8, **common
        )
        model = DSparkDraft(cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size))
    elif kind == "dflash":
        cfg = DFlashConfig(num_layers=1, block_size=5, mask_token_id=VOCAB - 1, **common)
        model = DFlashDraft(cfg, embed, torch.randn(DRAFT_VOCAB, SHAPE.hidden_size))
    else:
        model = Eagle3Draft(Eagle3Config(num_aux=2, ttt_steps=3, **common), embed)
    for p in model.parameters():  # away from the init, so a lost weight would show
        nn.init.normal_(p, std=0.2)
    return model


@pytest.fixture()
def drafts(tmp_path):
    """A drafts folder with one trained draft of every kind, under the kind's name."""
    embed = nn.Embedding(VOCAB, SHAPE.hidden_size)
    ids = torch.arange(DRAFT_VOCAB) * 2
    models = {}
    for kind in DRAFT_KINDS.names():
        models[kind] = tiny_draft(kind, embed)
        (tmp_path / kind).mkdir()
        save_draft(tmp_path / kind, models[kind], ids, {})
    return tmp_path, embed, ids, models


def context(folder, embed) -> ProposerContext:
    return ProposerContext(FakeTarget(embed), folder, ngram_k=4, ngram_window=(1, 3))


def test_a_name_registers_once():
    reg = Registry("thing")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a", 2)
    assert reg.get("a") == 1
    with pytest.raises(UnknownName, match="unknown thing 'b' \\(known: 'a'\\)"):
        reg.get("b")


def test_a_draft_kind_registered_twice_is_refused_and_changes_nothing():
    before = (DRAFT_KINDS.names(), METHODS.names())
    with pytest.raises(ValueError, match="draft kind 'dspark' is already registered"):
        register_draft(DraftKind(DSparkConfig, DSparkDraft, DSparkProposer, dspark_recipes))
    with pytest.raises(ValueError, match="method 'ngram' is already registered"):
        METHODS.register("ngram", lambda ctx: NoProposer())
    assert (DRAFT_KINDS.names(), METHODS.names()) == before


def test_every_draft_kind_is_a_method():
    assert set(DRAFT_KINDS.names()) <= set(METHODS.names())
    assert {"none", "ngram"} <= set(METHODS.names())


def test_the_params_schema_offers_exactly_the_registered_methods():
    """The schema reads the names declared in config.py (no torch there); this keeps them the
    registry's, in its order (the train stage's)."""
    assert DRAFT_NAMES.names() == DRAFT_KINDS.names() == ("dspark", "dflash", "eagle3")
    assert set(methods()) == set(METHODS.names())


def test_a_kind_params_cannot_name_is_refused():
    class MedusaConfig(DSparkConfig):
        kind = "medusa"

    before = DRAFT_KINDS.names()
    with pytest.raises(ValueError, match=r"'medusa' is not declared in dspark\.config"):
        register_draft(DraftKind(MedusaConfig, DSparkDraft, DSparkProposer, dspark_recipes))
    assert DRAFT_KINDS.names() == before


def test_every_method_builds(drafts):
    folder, embed, _, _ = drafts
    ctx = context(folder, embed)
    built = {m: build_proposer(m, ctx) for m in METHODS.names()}
    assert type(built["none"]) is NoProposer
    assert isinstance(built["ngram"], NgramProposer)
    assert (built["ngram"].k, built["ngram"].min_n, built["ngram"].max_n) == (4, 1, 3)
    assert isinstance(built["dspark"], DSparkProposer) and built["dspark"].k == 4
    assert isinstance(built["eagle3"], Eagle3Proposer) and built["eagle3"].k == 3
    assert type(built["dflash"]) is DFlashProposer and built["dflash"].k == 5
    assert built["dflash"].model.markov_head is built["dflash"].model.confidence_head is None
    hybrid = built["hybrid"]
    assert isinstance(hybrid, HybridProposer) and isinstance(hybrid.draft, DSparkProposer)
    assert (hybrid.k, hybrid.suffix.k, hybrid.suffix.max_match) == (4, 4, 64)  # the block's k
    assert hybrid.taps == built["dspark"].taps
    with pytest.raises(ConfigError, match="method: unknown method 'medusa'"):
        build_proposer("medusa", ctx)


def test_the_hybrid_pairs_with_the_draft_its_config_names(drafts):
    folder, embed, _, _ = drafts
    ctx = replace(context(folder, embed), hybrid=HybridConfig(draft="eagle3", k=6, max_match=9))
    hybrid = build_proposer("hybrid", ctx)
    assert isinstance(hybrid.draft, Eagle3Proposer)
    assert (hybrid.k, hybrid.suffix.k, hybrid.suffix.max_match) == (6, 6, 9)
    (folder / "eagle3" / "config.json").unlink()
    with pytest.raises(DataError, match=f"{folder / 'eagle3'}: no trained eagle3 draft"):
        build_proposer("hybrid", ctx)


def test_a_proposer_follows_the_checkpoints_kind_not_the_folders_name(drafts):
    """A Markov-ablation variant is a DSpark draft under another name."""
    folder, embed, ids, models = drafts
    name = next(iter(MARKOV_ABLATION))
    (folder / name).mkdir()
    save_draft(folder / name, models["dspark"], ids, {})
    assert isinstance(trained_proposer(context(folder, embed), name), DSparkProposer)


def test_a_missing_trained_draft_names_its_folder(tmp_path):
    ctx = context(tmp_path, nn.Embedding(VOCAB, SHAPE.hidden_size))
    with pytest.raises(DataError, match=f"{tmp_path / 'eagle3'}: no trained eagle3 draft"):
        build_proposer("eagle3", ctx)


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "dflash"])
def test_a_draft_loads_back_by_its_kind(drafts, kind):
    folder, embed, ids, models = drafts
    back, back_ids = load_draft(folder / kind, embed)
    assert type(back) is DRAFT_KINDS.get(kind).model
    assert back.cfg == models[kind].cfg
    assert torch.equal(back_ids, ids)
    want = models[kind].state_dict()
    got = back.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_unknown_kind_is_one_line_naming_the_file(drafts):
    folder, embed, _, _ = drafts
    path = folder / "dspark" / "config.json"
    doc = json.loads(path.read_text())
    doc["model"]["kind"] = "medusa"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as err:
        load_draft(folder / "dspark", embed)
    msg = str(err.value)
    assert msg.startswith(f"{path}: model.kind: unknown draft kind 'medusa'"), msg
    assert "\n" not in msg
    del doc["model"]["num_layers"]
    doc["model"]["kind"] = "dspark"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="model: malformed"):
        read_draft_config(folder / "dspark")


def test_every_serve_mode_serves_a_registered_method(drafts):
    from dspark.config import load_params
    from dspark.serve.server import proposer_for

    folder, embed, _, _ = drafts
    params = load_params(ROOT / "params.yaml", profile="smoke")
    built = {m: proposer_for(m, params, FakeTarget(embed), folder) for m in serving_modes()}
    assert {m: p.name for m, p in built.items()} == {
        "none": "none",
        "ngram": "ngram",
        "eagle3": "eagle3",
        "dflash": "dflash",
        "dspark_fixed": "dspark",
        "dspark_adaptive": "dspark",
        "hybrid": "hybrid",
    }
    assert built["hybrid"].draft.name == params.serve.hybrid.draft
    ngram = built["ngram"]
    assert (ngram.min_n, ngram.max_n) == params.serve.ngram_window
    assert ngram.k == (params.serve.ngram_k or params.train.dspark.block_size)


def test_every_mode_is_served_benchmarked_and_compared_offline():
    """The schema's modes, the engine's, the benchmark's speculative ones and the offline
    comparison's are one list: a mode added to one and not the others fails here."""
    from dspark.serve.bench import speculative
    from dspark.serve.llamacpp_mode import MODES as PEER_MODES
    from dspark.serve.offline import offline_method

    # vLLM's server and llama.cpp's (the peer) are no engine modes
    assert set(benchmark_modes()) == {*serving_modes(), "none_vllm", *PEER_MODES}
    assert set(speculative()) == set(serving_modes()) - {"none"}
    assert {m for m in benchmark_modes() if offline_method(m)} == set(speculative())
    assert {offline_method(m) for m in speculative()} <= set(METHODS.names())
