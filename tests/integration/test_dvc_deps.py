"""DVC reruns a stage when what it runs on changes, and only then: a scratch copy of the repo,
a stage committed as it stands, then one default (or one profile setting) edited in the copy."""

import json
import subprocess

import yaml

from ..conftest import copy_repo, tool_env

# A default that params.yaml leaves unset, so only config.py decides it.
DEFAULT = "    ce_weight: Annotated[float, Field(ge=0.0)] = 0.1\n"
EDITED = "    ce_weight: Annotated[float, Field(ge=0.0)] = 0.2\n"


def dvc(repo, *args) -> str:
    res = subprocess.run(
        ["dvc", *args], cwd=repo, capture_output=True, text=True, env=tool_env(), timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def stage_status(repo, stage="train") -> list:
    return json.loads(dvc(repo, "status", stage, "--json") or "{}").get(stage, [])


def placeholders(repo, *rels) -> None:
    for rel in rels:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel)


def test_a_changed_default_reruns_the_stage_and_an_unrelated_module_does_not(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    # The stage's data and outputs, as placeholders: the code deps are what is under test.
    placeholders(
        repo,
        "artifacts/target/t",
        "artifacts/shards/s",
        "artifacts/hidden/h",
        "artifacts/drafts/d",
        "artifacts/checkpoints/train/c",
        "plots/train_curves.csv",
        "plots/train_curves.png",
        "metrics/train.json",
    )
    dvc(repo, "commit", "--force", "train")
    assert stage_status(repo) == []

    client = repo / "dspark/serve/client.py"  # serving code: train never runs it
    client.write_text(client.read_text() + "\n# an edit train does not run\n")
    assert stage_status(repo) == []

    config = repo / "dspark/config.py"
    assert DEFAULT in config.read_text()
    config.write_text(config.read_text().replace(DEFAULT, EDITED))
    changed = stage_status(repo)
    assert {"changed deps": {"dspark/config.py": "modified"}} in changed, changed


def test_a_profile_train_setting_leaves_its_extraction_cached(tmp_path):
    """The full profile's epochs changed between sessions must not re-run hours of extraction
    (or provision); its extract settings must."""
    repo = copy_repo(tmp_path / "repo", profile="full")
    placeholders(
        repo,
        "artifacts/target/t",
        "artifacts/plan.json",
        "artifacts/shards/s",
        "artifacts/hidden/h",
        "metrics/provision.json",
        "metrics/extract.json",
    )
    dvc(repo, "commit", "--force", "provision", "extract")
    assert stage_status(repo, "provision") == stage_status(repo, "extract") == []

    path = repo / "params.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["profiles"]["full"]["train"]["epochs"] += 1
    path.write_text(yaml.safe_dump(raw))
    assert stage_status(repo, "provision") == stage_status(repo, "extract") == []

    raw["profiles"]["full"]["extract"] = {"workers": 3}
    path.write_text(yaml.safe_dump(raw))
    changed = stage_status(repo, "extract")
    assert {"changed deps": {"params.yaml": {"profiles.full.extract": "modified"}}} in changed
