"""The export stage: one speculators folder per trained block draft, each re-imported exactly,
and nothing left of a draft the profile no longer trains."""

import json

from dspark.export import export_stage
from dspark.io import atomic_dir
from dspark.train.checkpoint import save_draft
from tests.unit.test_spec_decode import trained_drafts


def test_dspark_and_dflash_folders_each_round_trip(
    tiny_target, tiny_target_dir, smoke_params, tmp_path
):
    drafts = tmp_path / "drafts"
    for name, (model, ids) in trained_drafts(tiny_target).items():
        with atomic_dir(drafts / name) as tmp:
            save_draft(tmp, model, ids, {})
    out = tmp_path / "export"
    (out / "medusa").mkdir(parents=True)  # a draft kind this profile does not train (any more)
    got = export_stage(smoke_params, drafts_dir=drafts, target_dir=tiny_target_dir, out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == ["dflash", "dspark"]
    assert got["roundtrip_max_abs_diff"] == 0.0 and got["roundtrip_vocab_equal"]
    assert got["dflash"]["roundtrip_max_abs_diff"] == 0.0 and got["dflash"]["roundtrip_vocab_equal"]
    for kind in ("dspark", "dflash"):
        doc = json.loads((out / kind / "config.json").read_text())
        assert doc["speculators_model_type"] == kind


def test_only_the_drafts_the_profile_trains_are_exported(
    tiny_target, tiny_target_dir, smoke_params, tmp_path
):
    """Training DFlash alone (`train.drafts=[dflash]`), export finds no DSpark folder to miss."""
    drafts = tmp_path / "drafts"
    model, ids = trained_drafts(tiny_target)["dflash"]
    with atomic_dir(drafts / "dflash") as tmp:
        save_draft(tmp, model, ids, {})
    params = smoke_params.model_copy(
        update={"train": smoke_params.train.model_copy(update={"drafts": ["dflash"]})}
    )
    out = tmp_path / "export"
    got = export_stage(params, drafts_dir=drafts, target_dir=tiny_target_dir, out_dir=out)
    assert [p.name for p in out.iterdir()] == ["dflash"]
    assert got["dflash"]["roundtrip_max_abs_diff"] == 0.0 and "roundtrip_max_abs_diff" not in got
