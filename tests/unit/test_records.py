"""A long stage's records: kept across a rerun with the same fingerprint, dropped otherwise, and
fingerprinted by the same code files DVC hashes for the stage."""

import json
from pathlib import Path

from dspark.pipeline import BY_NAME
from dspark.records import PKG, Records, code_files, fingerprint

ROOT = Path(__file__).resolve().parents[2]


def test_code_files_are_the_library_files_among_the_stage_deps():
    files = code_files(("artifacts/target", "dspark/decode", "dspark/data/prompts.py"))
    assert PKG / "data" / "prompts.py" in files
    assert PKG / "decode" / "decoder.py" in files
    assert all(f.is_relative_to(PKG) for f in files)  # artifacts/ is data, not code
    assert PKG / "data" / "prepare.py" not in files  # only the module named


def test_every_module_a_recorded_stage_imports_for_its_outcomes_is_fingerprinted():
    for stage in ("evaluate", "benchmark"):
        names = {str(f.relative_to(PKG)) for f in code_files(BY_NAME[stage].deps)}
        assert {"records.py", "config.py", "data/prompts.py", "drafts.py"} <= names, stage


def test_fingerprint_follows_the_basis_the_inputs_and_the_code(tmp_path):
    draft = tmp_path / "w.safetensors"
    draft.write_bytes(b"a")
    deps = ("dspark/records.py",)
    fp = fingerprint({"k": 1}, [draft], deps)
    assert fp == fingerprint({"k": 1}, [draft], deps)
    assert fp != fingerprint({"k": 2}, [draft], deps)
    assert fp != fingerprint({"k": 1}, [draft], ("dspark/io.py",))
    draft.write_bytes(b"b")
    assert fp != fingerprint({"k": 1}, [draft], deps)


def test_a_rerun_keeps_what_finished_and_a_new_fingerprint_drops_it(tmp_path):
    first = Records(tmp_path, "aaaa")
    first.put("x", v=1)
    # A stop mid-write leaves a cut line: everything before it stands.
    with first.path.open("a") as f:
        f.write('{"key": "y", "v"')
    again = Records(tmp_path, "aaaa")
    assert set(again.done) == {"x"} and again.get("x")["v"] == 1 and again.replayed == 1
    assert [json.loads(line)["key"] for line in again.path.read_text().splitlines()] == ["x"]
    Records(tmp_path, "bbbb")
    assert not (tmp_path / "aaaa.jsonl").exists()
    again.clear()
    assert not again.done


def test_each_recorded_stage_passes_its_own_deps_down_for_the_fingerprint(tmp_path, monkeypatch):
    """The stage registry hands a stage its deps (`paths.code`): the library below it never
    imports the registry to look them up."""
    import dspark.evaluate.stage
    import dspark.serve.bench
    from dspark.config import load_params
    from dspark.pipeline import StageContext

    seen = {}
    monkeypatch.setattr(
        dspark.evaluate.stage, "evaluate_stage", lambda p, paths, **_: seen.update(evaluate=paths)
    )
    monkeypatch.setattr(
        dspark.serve.bench,
        "benchmark_stage",
        lambda p, paths, root, **_: seen.update(benchmark=paths),
    )
    ctx = StageContext(params=load_params(ROOT / "params.yaml"), root=tmp_path)
    for stage in ("evaluate", "benchmark"):
        BY_NAME[stage].run(ctx)
        assert seen[stage].code == BY_NAME[stage].deps, stage
