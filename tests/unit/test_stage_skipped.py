"""How the flow's stage task reads `dvc repro --single-item`'s output to know a stage was
skipped, without a `dvc status` first (DVC 3's lines)."""

from tasks.repro import skipped


def test_unchanged_and_run_cache_are_told_apart():
    unchanged = "Stage 'train' didn't change, skipping\nData and pipelines are up to date.\n"
    restored = "Stage 'export' is cached - skipping run, checking out outputs\n"
    assert skipped("train", unchanged) == "unchanged"
    assert skipped("export", restored) == "run-cache"


def test_a_stage_that_ran_is_not_skipped_whatever_its_command_printed():
    out = (
        "Running stage 'train':\n> dspark train\n"
        "note: Stage 'train' didn't change, skipping (quoted by the command)\n"
        "Stage 'prepare' didn't change, skipping\n"
        "Updating lock file 'dvc.lock'\n"
    )
    assert skipped("train", out) is None
    assert skipped("train", "") is None
