"""Our per-slot loss terms are speculators 0.9.0's, on identical logits: TV (one minus the
acceptance), forward KL and CE on the target's argmax, each slot and their DSpark-decayed means,
computed by its own functions in its own venv. With the full vocabulary as the draft's, where
the two agree by definition; with a reduced one ours also counts the target's mass outside the
draft vocabulary as mismatch, which speculators' renormalized targets do not (tested apart)."""

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.train.losses import LossWeights, slot_losses

from .test_parity import SPEC_PY, spec_python  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("loss_terms.py")
N, K, D, GAMMA = 6, 4, 50, 4.0


def ours(logits, target_logits, valid, **weights):
    p = torch.softmax(target_logits, -1)
    labels = target_logits.argmax(-1)
    return slot_losses(logits, p, labels, valid, LossWeights(gamma=GAMMA, **weights))


def test_our_loss_terms_are_speculators_own(spec_python, tmp_path):  # noqa: F811
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(N, K, D, generator=gen) * 2
    targets = torch.randn(N, K, D, generator=gen) * 3
    valid = torch.ones(N, K, dtype=torch.bool)
    valid[1, 2:] = False  # a block cut short by the sequence's end
    mask = valid.to(torch.int64).cumprod(-1).bool()
    save_file(
        {
            "logits": logits.reshape(1, N * K, D).contiguous(),
            "targets": targets.reshape(1, N * K, D).contiguous(),
            "loss_mask": mask.reshape(1, N * K).float().contiguous(),
            "block_size": torch.tensor([K]),
        },
        tmp_path / "in.safetensors",
    )
    subprocess.run(
        [str(SPEC_PY), str(SCRIPT), str(tmp_path / "in.safetensors"),
         str(tmp_path / "out.safetensors"), str(GAMMA)],
        check=True,
    )  # fmt: skip
    theirs = {k: v.reshape(N, K) if v.numel() == N * K else v for k, v in
              load_file(tmp_path / "out.safetensors").items()}  # fmt: skip
    tv = ours(logits, targets, valid, ce=0.0, tv=1.0)
    assert torch.allclose(1 - tv["accept"][mask], theirs["tv"][mask], atol=1e-5)
    assert float(tv["loss"]) == pytest.approx(float(theirs["tv_mean"]), rel=1e-4)
    kl = ours(logits, targets, valid, ce=0.0, tv=0.0, kl=1.0)
    assert float(kl["loss_kl"]) == pytest.approx(float(theirs["kl_mean"]), rel=1e-4)
    ce = ours(logits, targets, valid, ce=1.0, tv=0.0)
    assert float(ce["loss_ce"]) == pytest.approx(float(theirs["ce_mean"]), rel=1e-4)


def test_mass_outside_the_draft_vocabulary_counts_as_mismatch():
    """The deliberate difference: a draft that matches the target within its vocabulary but
    lacks a token holding half the target's mass is accepted half the time, not always."""
    p = torch.tensor([[[0.25, 0.25]]])  # the other half is outside the draft's two tokens
    logits = torch.log(torch.tensor([[[0.5, 0.5]]]))
    out = slot_losses(logits, p, torch.tensor([[0]]), torch.ones(1, 1, dtype=bool), LossWeights())
    assert float(out["accept"]) == pytest.approx(0.5)
