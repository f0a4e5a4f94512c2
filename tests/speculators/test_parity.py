"""Our speculators exports, loaded by speculators 0.9.0's own DSparkDraftModel and DFlashDraftModel
(in its own venv, `make speculators-venv`), give our logits and confidences."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.export import export_speculators
from dspark.models.vocab import build_draft_ids
from dspark.train.stage import build_runs

from ..conftest import skip_or_fail
from ..integration.test_train import tiny_params

ROOT = Path(__file__).resolve().parents[2]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
SCRIPT = Path(__file__).with_name("load_export.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_python() -> Path:
    if not SPEC_PY.is_file():
        skip_or_fail(f"speculators venv missing ({SPEC_PY}): run `make speculators-venv`")
    return SPEC_PY


@pytest.mark.parametrize(
    "kind,variant,rank,reduced",
    [
        ("dspark", "vanilla", 16, True),
        ("dspark", "gated", 16, True),
        ("dspark", "rnn", 8, False),
        ("dflash", "vanilla", 16, True),  # no heads: rank and variant do not apply
    ],
)
def test_speculators_loads_our_export_with_our_logits(
    spec_python, smoke_params, tiny_target, tiny_target_dir, tmp_path, kind, variant, rank, reduced
):
    params = tiny_params(smoke_params)
    tree = params.model_dump()
    tree["train"]["dspark"].update(markov_head=variant, markov_rank=rank)
    from dspark.config import Params

    params = Params.model_validate(tree)
    vocab = tiny_target.vocab_size
    counts = torch.randint(0, 50, (vocab,), generator=torch.Generator().manual_seed(1))
    draft_ids = build_draft_ids(counts, 512 if reduced else None)
    runs = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)
    model = next(r.model for r in runs if r.name == kind)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "lm_head.weight":  # the target's rows: speculators reloads them
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    export_speculators(
        model,
        draft_ids,
        tmp_path / "export",
        verifier_config=tiny_target.model.config.to_dict(),
        verifier_path="HuggingFaceTB/SmolLM2-135M-Instruct",  # a public id, as exports name it
        verifier_local_path=str(tiny_target_dir),  # what load_export.py loads it from, offline
    )
    s = 40
    ids = torch.randint(10, vocab, (1, s), generator=gen)
    aux = torch.randn(1, s, 2 * 64, generator=gen)
    anchors = torch.tensor([1, 6, 7, 15, 30])  # none in the last block (speculators' rule)
    save_file({"input_ids": ids, "aux": aux, "anchors": anchors}, tmp_path / "in.safetensors")
    proc = subprocess.run(
        [
            str(spec_python),
            str(SCRIPT),
            str(tmp_path / "export"),
            str(tmp_path / "in.safetensors"),
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(tmp_path / "out.safetensors")
    with torch.no_grad():
        logits, conf = model.forward_train(ids, aux, anchors[None])
    diff = (logits - theirs["logits"]).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff}"
    if kind == "dspark":
        assert (conf - theirs["confidence"]).abs().max().item() < 1e-4
    else:
        assert conf is None and "confidence" not in theirs
    if reduced:
        assert torch.equal(torch.arange(512) + theirs["d2t"], draft_ids)
