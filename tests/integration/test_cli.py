import itertools
import subprocess
import sys

from dspark.pipeline import STAGES, dvc_yaml, watched_params

from ..conftest import ROOT, tool_env


def test_help_lists_the_stages_and_imports_nothing_heavy():
    """What keeps `--help` fast: lazy imports. Its time is measured by benchmarks/cli.py, not
    asserted here (a shared machine's load would decide a timed test)."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dspark", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for stage in STAGES:
        assert stage.name in res.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert {"dspark", "argparse"} <= imported  # the trace was read
    heavy = {"torch", "transformers", "safetensors", "numpy", "prefect", "mlflow", "dvc"}
    assert not imported & heavy


def test_dvc_yaml_is_derived_from_the_registry():
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml()


def test_every_stage_param_is_written_in_params_yaml():
    """DVC reads a stage's dotted params from the file itself, defaults do not count."""
    import yaml

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for stage, profile in itertools.product(STAGES, raw["profiles"]):
        for key in watched_params(stage):
            node = raw
            for part in key.replace("${profile}", profile).split("."):
                assert isinstance(node, dict) and part in node, f"{stage.name}: {key} ({profile})"
                node = node[part]


def test_flows_cover_every_stage():
    from flows.stages import STAGE_FLOWS

    assert list(STAGE_FLOWS) == [s.name for s in STAGES]


def test_unwritable_output_directory_is_exit_2(tmp_path):
    (tmp_path / "artifacts").write_text("a file where a folder should be")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark",
            "provision",
            "--params",
            str(ROOT / "params.yaml"),
            "--profile",
            "smoke",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=tool_env(),
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("dspark: error: ")
    assert "not writable" in res.stderr


def test_unknown_category_in_user_prompts_is_exit_2(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"category": "poetry", "prompt": "x"}\n')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark",
            "prepare",
            "--params",
            str(ROOT / "params.yaml"),
            "--profile",
            "smoke",
            "--prompts",
            str(bad),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"dspark: error: {bad}:1: unknown category 'poetry' (known: HumanEval, math_reasoning, "
        "qa, question, rag, summarization, tool_call, translation, writing, long_context, "
        "long_context_4k)"
    ]
