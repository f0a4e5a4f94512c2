"""Adding a draft is one module plus its registry entry (docs/training.md, "Adding a draft"): a
toy kind defined and registered in this file alone is named by params, started and trained by
the train stage's run builder, saved, loaded and decoded losslessly, exported and read back, and
listed by the CLI. A place that named the library's own three drafts would miss the toy."""

import json
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from dspark.cli import build_parser
from dspark.config import DRAFT_NAMES, OptimConfig, declare_draft, load_params
from dspark.data.shards import TokenSample
from dspark.decode.drafters import DFlashProposer
from dspark.drafts import (
    DRAFT_KINDS,
    METHODS,
    DraftKind,
    ProposerContext,
    block_model,
    build_proposer,
    register_draft,
)
from dspark.errors import ConfigError
from dspark.export import export_stage
from dspark.extract.capture import HiddenStateCapture
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.train.batch import TargetHead, collate
from dspark.train.checkpoint import save_draft
from dspark.train.losses import LossWeights
from dspark.train.objectives import DSparkObjective
from dspark.train.recipes import Recipe, Setup, block_draft, block_fields
from dspark.train.stage import build_runs
from tests.conftest import ROOT
from tests.unit.conftest import NEW
from tests.unit.test_spec_decode import decoder

# --- the toy: DFlash's one-layer block under a name of its own ----------------------------------


@dataclass(frozen=True)
class ToyConfig(DFlashConfig):
    kind: ClassVar[str] = "toy"


class ToyDraft(DFlashDraft):
    cfg: ToyConfig


class ToyProposer(DFlashProposer):
    name = "toy"


def toy_recipes(s: Setup) -> list[Recipe]:
    """One layer over train.dspark's block, trained on cross-entropy alone."""
    cfg = ToyConfig(num_layers=1, **block_fields(s))
    model = block_draft(s, ToyDraft, cfg, output_scale=1.0, qk=1.0)
    weights = LossWeights(ce=1.0, tv=0.0, kl=0.0, gamma=4.0)
    objective, measure = DSparkObjective(weights, 16), DSparkObjective(weights, None)
    return [Recipe("toy", model, objective, measure, OptimConfig(), cfg.draft_slots)]


@pytest.fixture
def toy():
    """The toy's registry entry (its name declared where params read it), undone after."""
    declare_draft("toy")
    try:
        yield register_draft(
            DraftKind(
                ToyConfig,
                ToyDraft,
                ToyProposer,
                recipes=toy_recipes,
                build=block_model,
                export="ToySpeculator",
            )
        )
    finally:
        for registry in (METHODS, DRAFT_KINDS, DRAFT_NAMES):
            if "toy" in registry.names():
                registry.remove("toy")


def hidden_samples(target, n: int = 4):
    """The target's hidden states (layers 0 and 1) on random sequences, answers from token 8."""
    gen = torch.Generator().manual_seed(0)
    cap = HiddenStateCapture(target, [0, 1], "float32")
    out = []
    for i in range(n):
        ids = torch.randint(10, 2000, (24 + 3 * i,), generator=gen, dtype=torch.int32)
        mask = torch.arange(ids.numel()) >= 8
        out.append(cap(TokenSample(i, f"p{i}", ids, mask)))
    cap.close()
    return out


def test_a_toy_draft_is_named_trained_decoded_exported_and_listed(
    toy, varied, llama, prompts, reference, tiny_target_dir, tmp_path, capsys
):
    # Params name it, and the lists that follow train.drafts carry it.
    params = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=["train.drafts=[toy]", "evaluate.hybrid.draft=toy"],
    )
    assert params.train.drafts == ["toy"] and params.evaluate.hybrid.draft == "toy"
    assert "toy" in params.evaluate.methods and "toy" in params.benchmark.modes
    with pytest.raises(ConfigError, match=r"train\.drafts\.0: .*'eagle3' or 'toy' \(got 'x'\)"):
        load_params(ROOT / "params.yaml", overrides=["train.drafts=[x]"])

    # The train stage's run builder starts it alone, and a few steps train it.
    samples = hidden_samples(varied)
    draft_ids = build_draft_ids(count_tokens(samples, varied.vocab_size), 256)
    runs = build_runs(params, varied, draft_ids, [0, 1], mask_id=3)
    assert [r.name for r in runs] == ["toy"] and type(runs[0].model) is ToyDraft
    run = runs[0]
    start = [p.detach().clone() for p in run.params]
    batch = collate(samples, TargetHead(varied.norm, varied.lm_head, draft_ids))
    for step in range(3):
        run.step(batch, step, total=3, seed=0, prep_s=0.0)  # (raises on a non-finite loss)
    assert any(not torch.equal(a, b) for a, b in zip(start, run.params, strict=True))

    # Saved as the stage saves it, it loads back by its kind and decodes losslessly.
    drafts = tmp_path / "drafts"
    (drafts / "toy").mkdir(parents=True)
    save_draft(drafts / "toy", run.model, draft_ids, {})
    ctx = ProposerContext(varied, drafts, 4, (1, 3), params.evaluate.hybrid)
    proposer = build_proposer("toy", ctx)
    assert type(proposer) is ToyProposer and type(proposer.model) is ToyDraft
    traces, _ = decoder(llama, varied, proposer).generate(prompts, NEW)
    assert [t.tokens for t in traces] == reference
    assert build_proposer("hybrid", ctx).draft.name == "toy"

    # The export stage writes it under its architecture and reads it back exactly.
    out_dir = tmp_path / "export"
    got = export_stage(params, drafts_dir=drafts, target_dir=tiny_target_dir, out_dir=out_dir)
    assert got["toy"]["roundtrip_max_abs_diff"] == 0.0 and got["toy"]["roundtrip_vocab_equal"]
    doc = json.loads((out_dir / "toy" / "config.json").read_text())
    assert doc["architectures"] == ["ToySpeculator"] and doc["speculators_model_type"] == "toy"

    # The CLI lists its serving mode.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["endpoint", "--help"])
    assert re.search(r"eagle3,\s+toy,\s+hybrid", capsys.readouterr().out)
