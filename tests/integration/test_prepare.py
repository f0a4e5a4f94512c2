import json

import pytest

from dspark.config import load_params
from dspark.data import shards
from dspark.data.prepare import PreparePaths, prepare_stage
from dspark.data.prompts import read_prompt_file
from dspark.errors import DataError

from ..conftest import ROOT, write_jsonl


@pytest.fixture
def train_file(tmp_path):
    eval_prompt = "Which blood type makes the best CEOs?"  # a TruthfulQA eval question
    rows = [
        {"category": "train", "messages": [{"role": "user", "content": f"Tell me about {w}."}]}
        for w in ("owls", "rivers", "copper", "tea", "maps", "bridges", "salt")
    ]
    rows.insert(2, {"category": "question", "prompt": eval_prompt})
    return write_jsonl(tmp_path / "train.jsonl", rows)


def run(tiny_target, tiny_target_dir, tmp_path, train_file, *sets):
    params = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            f"data.train_sources=[{train_file}]",
            "prepare.num_samples=6",
            "prepare.shard_size=4",
            "data.eval_counts={question: 20, HumanEval: 1}",
            "prepare.engine=hf",  # generation here (the extract generator: test_stream)
            *sets,
        ],
    )
    paths = PreparePaths(
        target=tiny_target_dir,
        shards=tmp_path / "shards",
        eval_prompts=tmp_path / "eval.jsonl",
        events=tmp_path / "events.jsonl",
        lengths_plot=tmp_path / "lengths.csv",
    )
    return prepare_stage(params, tiny_target, paths, progress=False), paths


def test_shards_masks_and_eval_exclusion(tiny_target, tiny_target_dir, tmp_path, train_file):
    metrics, paths = run(tiny_target, tiny_target_dir, tmp_path, train_file)
    assert metrics["num_samples"] == 6 and metrics["skipped_eval_overlap"] == 1
    eval_hashes = {p.content_hash for p in read_prompt_file(paths.eval_prompts)}
    samples = list(shards.iter_samples(paths.shards))
    assert [s.sample_id for s in samples] == list(range(6))
    for s in samples:
        text = tiny_target.tokenizer.decode(s.input_ids[~s.loss_mask].tolist())
        assert "blood type" not in text
        # the loss mask is exactly the response: a suffix after the chat-templated prompt
        first = int(s.loss_mask.int().argmax())
        assert s.loss_mask[first:].all() and not s.loss_mask[:first].any()
        prompt_text = tiny_target.tokenizer.decode(s.input_ids[:first].tolist())
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert int(s.loss_mask.sum()) <= 16
    assert eval_hashes  # built and written
    assert metrics["regenerated"] == 6  # JSONL prompts carry no answer to keep
    events = [json.loads(line) for line in paths.events.read_text().splitlines()]
    assert [e["metrics"]["samples"] for e in events] == [4, 6]
    rows = paths.lengths_plot.read_text().splitlines()
    assert rows[0] == "sample_id,prompt_tokens,response_tokens" and len(rows) == 7
    assert sum(int(r.split(",")[2]) for r in rows[1:]) == metrics["response_tokens"]


def test_resume_skips_finished_shards(tiny_target, tiny_target_dir, tmp_path, train_file):
    _first, paths = run(tiny_target, tiny_target_dir, tmp_path, train_file)
    before = shards.read_manifest(paths.shards)
    (paths.shards / shards.MANIFEST).unlink()  # as if the run died before finishing
    again, _ = run(tiny_target, tiny_target_dir, tmp_path, train_file)
    assert again["reused_shards"] == 2
    assert shards.read_manifest(paths.shards)["shards"] == before["shards"]
    changed, _ = run(tiny_target, tiny_target_dir, tmp_path, train_file, "prepare.max_new_tokens=8")
    assert changed["reused_shards"] == 0  # a changed param redoes the work


def test_kept_answers_come_from_the_dataset(tiny_target, tiny_target_dir, tmp_path):
    params = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            "prepare.num_samples=4",
            "prepare.regenerate_fraction=0.0",
            "data.eval_counts={qa: 1}",
        ],
    )
    paths = PreparePaths(
        target=tiny_target_dir, shards=tmp_path / "s", eval_prompts=tmp_path / "e.jsonl"
    )
    metrics = prepare_stage(params, tiny_target, paths, progress=False)
    assert metrics["regenerated"] == 0 and metrics["kept_from_dataset"] == 4
    s = next(shards.iter_samples(paths.shards))
    response = s.input_ids[s.loss_mask].tolist()
    assert response[-1] == tiny_target.eos_token_id and len(response) == 16


def test_sampled_generation_is_reproducible(tiny_target, tiny_target_dir, tmp_path, train_file):
    """The same seed gives the same responses; another seed, another temperature, or greedy
    decoding gives others (the first check alone passes if the settings are ignored)."""

    def responses(tag: str, *sets: str) -> list[list[int]]:
        run(tiny_target, tiny_target_dir, tmp_path / tag, train_file, *sets)
        samples = shards.iter_samples(tmp_path / tag / "shards")
        return [s.input_ids[s.loss_mask].tolist() for s in samples]

    sampled = ("prepare.sampling.greedy=false",)
    a = responses("a", *sampled)
    assert len(a) == 6 and a == responses("b", *sampled)
    assert responses("seed", *sampled, "prepare.seed=1") != a
    assert responses("hot", *sampled, "prepare.sampling.temperature=2.0") != a
    assert responses("greedy") != a


def from_prompt_file(path, target_dir, tmp_path):
    """Smoke params training on the prompt file `path`, and where prepare writes."""
    params = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[f"data.train_sources=[{path}]", "data.eval_counts={qa: 1}"],
    )
    paths = PreparePaths(
        target=target_dir, shards=tmp_path / "s", eval_prompts=tmp_path / "e.jsonl"
    )
    return params, paths


def test_no_usable_prompts(tiny_target, tiny_target_dir, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"category": "x", "prompt": "word " * 400}])
    params, paths = from_prompt_file(path, tiny_target_dir, tmp_path)
    with pytest.raises(DataError, match="give 0 usable prompts"):
        prepare_stage(params, tiny_target, paths, progress=False)


def test_too_few_prompts_for_num_samples_fails_before_generating(
    tiny_target, tiny_target_dir, tmp_path
):
    lines = [{"category": "x", "prompt": f"Question {i}?"} for i in range(3)]
    lines += [
        {"category": "x", "prompt": "word " * 400},
        {"category": "x", "prompt": "Question 0?"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    params, paths = from_prompt_file(path, tiny_target_dir, tmp_path)
    message = (
        r"prepare.num_samples: 8 asked, data.train_sources give 3 usable prompts \(1 longer "
        r"than prepare.max_prompt_tokens, 1 duplicates, 0 in the eval set\)"
    )
    with pytest.raises(DataError, match=message):
        prepare_stage(params, tiny_target, paths, progress=False)
    assert not list(paths.shards.glob("*.safetensors"))


def test_validation_split_comes_first_and_is_never_trained_on(
    tiny_target, tiny_target_dir, tmp_path, train_file
):
    """data.val_sources: the first train.eval_samples samples are its prompts (the train stage
    holds out the lowest ids), and a training prompt equal to one of them is skipped."""
    rows = [{"category": "train", "prompt": f"Tell me about {w}."} for w in ("owls", "glass")]
    val_file = write_jsonl(tmp_path / "val.jsonl", rows)
    metrics, paths = run(
        tiny_target,
        tiny_target_dir,
        tmp_path,
        train_file,
        f"data.val_sources=[{val_file}]",
        "train.eval_samples=2",
    )
    samples = list(shards.iter_samples(paths.shards))
    prompts = [tiny_target.tokenizer.decode(s.input_ids[~s.loss_mask].tolist()) for s in samples]
    assert "owls" in prompts[0] and "glass" in prompts[1]
    assert not any("owls" in p for p in prompts[2:])  # the training file's owls: held out
    assert metrics["skipped_validation"] == 1 and metrics["num_samples"] == 6
    manifest = shards.read_manifest(paths.shards)
    assert manifest["validation_samples"] == 2
    assert manifest["validation_sources"] == [str(val_file)] * 2  # the train stage's groups


def test_too_few_validation_prompts_is_a_clear_error(
    tiny_target, tiny_target_dir, tmp_path, train_file
):
    val_file = write_jsonl(
        tmp_path / "val.jsonl", [{"category": "train", "prompt": "Name a river."}]
    )
    with pytest.raises(DataError, match=r"data.val_sources: 1 usable prompts for train.eval_s"):
        run(
            tiny_target,
            tiny_target_dir,
            tmp_path,
            train_file,
            f"data.val_sources=[{val_file}]",
            "train.eval_samples=2",
        )


def test_weights_are_shares_of_the_usable_prompts(tiny_target, tiny_target_dir, tmp_path):
    """A source that loses prompts to the length cap still gets its share of the samples."""
    long_text = "word " * 400  # over the smoke profile's max_prompt_tokens (256)
    a_rows = []
    for i in range(6):
        a_rows += [{"category": "train", "prompt": f"{long_text}{i}"}]
        a_rows += [{"category": "train", "prompt": f"Alpha topic {i}."}]
    b_rows = [{"category": "train", "prompt": f"Beta topic {i}."} for i in range(6)]
    files = [
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
        for name, rows in (("a", a_rows), ("b", b_rows))
    ]
    metrics, paths = run(
        tiny_target,
        tiny_target_dir,
        tmp_path,
        files[0],
        f"data.train_sources=[{files[0]},{files[1]}]",
        "data.train_weights=[1,2]",
    )
    prompts = [
        tiny_target.tokenizer.decode(s.input_ids[~s.loss_mask].tolist())
        for s in shards.iter_samples(paths.shards)
    ]
    assert ["Alpha" in p for p in prompts] == [False, True, False, False, True, False]
    assert metrics["skipped_too_long"] == 2
