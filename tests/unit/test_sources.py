import json
from itertools import islice

import pytest

from dspark.config import CATEGORIES, Params
from dspark.data import eval_sources, train_sources
from dspark.data.prompts import content_hash
from dspark.data.train_sources import iter_json_array, iter_sharegpt, iter_training_prompts
from dspark.errors import DataError


@pytest.fixture(scope="module")
def default_eval(tiny_target):
    counts = Params(profile="t").data.eval_counts
    counts = {**counts, "long_context": 1, "long_context_4k": 1}

    def count(text):
        return len(tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"])

    return eval_sources.build_eval_prompts(
        counts, seed=0, count_tokens=count, long_context_tokens=8056
    ), count


def test_every_category_has_its_default_count(default_eval):
    prompts, _ = default_eval
    by_cat = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    assert len(by_cat["HumanEval"]) == 164
    for category in CATEGORIES:
        assert len(by_cat[category]) >= 20, category
        assert len({p.id for p in by_cat[category]}) == len(by_cat[category])
        assert len({p.content_hash for p in by_cat[category]}) == len(by_cat[category])


def test_long_context_fills_the_budget_without_repeating_a_passage(default_eval):
    prompts, count = default_eval
    long = next(p for p in prompts if p.category == "long_context")
    n = count(long.messages[-1]["content"])
    assert 0.9 * 8056 <= n <= 8056
    docs = long.messages[-1]["content"].split("\n\n---\n\n")
    assert len(docs) == len(set(docs)) and len(docs) > 1
    four_k = next(p for p in prompts if p.category == "long_context_4k")
    assert 0.9 * 4096 <= count(four_k.messages[-1]["content"]) <= 4096


def test_selection_is_seeded():
    a = eval_sources.math_reasoning(5, seed=0)
    assert a == eval_sources.math_reasoning(5, seed=0)
    assert a != eval_sources.math_reasoning(5, seed=1)


def test_unknown_category_is_rejected():
    with pytest.raises(DataError, match="unknown category 'poetry'"):
        eval_sources.build_eval_prompts({"poetry": 3}, 0, count_tokens=len, long_context_tokens=100)


def test_truncated_json_array_yields_the_complete_records():
    text = json.dumps([{"a": 1}, {"a": 2}, {"a": 3}])
    assert list(iter_json_array(text[:-5])) == [{"a": 1}, {"a": 2}]
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_sharegpt_gives_the_seeds_half_first_then_every_other_record():
    every = [p.id for p in iter_sharegpt()]
    where = {pid: i for i, pid in enumerate(every)}
    drawn = {}
    for seed in (0, 1):
        got = [p.id for p in iter_training_prompts(["sharegpt"], seed)]
        assert sorted(got) == sorted(every)  # a large draw can use the whole corpus
        order = [where[pid] for pid in got]
        restarts = [i for i in range(1, len(order)) if order[i] < order[i - 1]]
        assert len(restarts) == 1 and abs(restarts[0] - len(got) / 2) < len(got) / 10  # two halves
        drawn[seed] = set(got[:500])
    assert len(drawn[0] & drawn[1]) < 400  # which records come first depends on the seed


def test_training_and_evaluation_prompts_never_overlap(default_eval):
    """By content hash, over the full eval set and the first 3000 ShareGPT conversations.

    The prepare stage drops any training prompt whose hash is an evaluation prompt's; this checks
    the sources themselves do not collide either (test_prepare covers the filter).
    """
    prompts, _ = default_eval
    eval_hashes = {p.content_hash for p in prompts}
    train_hashes = set()
    for n, p in enumerate(iter_sharegpt()):
        train_hashes.add(p.content_hash)
        if n >= 3000:
            break
    assert len(train_hashes) > 2000
    assert eval_hashes.isdisjoint(train_hashes)
    assert content_hash(prompts[0].text) in eval_hashes


@pytest.mark.slow
def test_the_378k_gpu_case_has_enough_distinct_text(tiny_target):
    """The k3 preset asks for 378K-token prompts: essays and agent transcripts must cover it
    with no document repeated (SmolLM2's tokenizer stands in for K3's)."""

    def count(text):
        return len(tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"])

    (prompt,) = eval_sources.long_context(1, seed=0, num_tokens=378_000, count_tokens=count)
    docs = prompt.messages[-1]["content"].split("\n\n---\n\n")
    assert len(docs) == len(set(docs))
    assert 0.9 * 378_000 <= count(prompt.messages[-1]["content"]) <= 378_000


def test_interleave_keeps_each_streams_share_and_drops_an_exhausted_one():
    def stream(name, n):
        return (name + str(i) for i in range(n))

    out = list(train_sources.interleave([stream("a", 100), stream("b", 100)], [3.0, 1.0]))
    assert out[:8] == ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5"]  # a, a, b, a, ...
    assert sum(x[0] == "a" for x in out[:40]) == 30
    # b outlives a: after a's 100, the rest is b's, each stream in its own order.
    assert [x for x in out if x[0] == "a"] == [f"a{i}" for i in range(100)]
    assert [x for x in out if x[0] == "b"] == [f"b{i}" for i in range(100)]
    short = list(train_sources.interleave([stream("a", 2), stream("b", 10)], [1.0, 1.0]))
    assert len(short) == 12 and short[-8:] == [f"b{i}" for i in range(2, 10)]


def test_code_stubs_stop_at_the_docstring_and_keep_the_whole_function(tmp_path):
    pkg = tmp_path / "lib" / "mod"
    (tmp_path / "lib" / "test").mkdir(parents=True)
    pkg.mkdir()
    body = "    a = 1\n    b = 2\n    c = a + b\n    return c\n"
    doc = '    """Add one and two and give the sum back to the caller, always three."""\n'
    (pkg / "m.py").write_text(
        f"def add_up():\n{doc}{body}\n"
        f"def _private():\n{doc}{body}\n"  # private: skipped
        "def short():\n    '''Too little to complete: one statement, a long docstring.'''\n"
        "    return 1\n"
    )
    (tmp_path / "lib" / "test" / "t.py").write_text(f"def add_up():\n{doc}{body}")  # tests: skipped
    stubs = train_sources.function_stubs(tmp_path / "lib")
    assert [s[0] for s in stubs] == ["mod.m.add_up.1"]
    _, stub, whole = stubs[0]
    assert stub == "def add_up():\n" + doc.rstrip("\n")
    assert whole == f"def add_up():\n{doc}{body}".rstrip("\n")
    (prompt,) = train_sources.iter_code(0, tmp_path / "lib")
    assert stub in prompt.text and prompt.reference.endswith("return c\n```")


def test_translation_passages_are_plain_prose_of_the_replies(tmp_path):
    prose = (
        "The river bends twice before it reaches the town. Fishermen wait there at dawn "
        "for the tide. Their boats are painted blue and green, as their fathers' were."
    )
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": f"Sure!\n{prose}\nMore."},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": "code?"},
                {"from": "gpt", "value": "x = [1, 2] # {} <> " * 10},
            ],
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    (prompt,) = train_sources.iter_translation(0, path)
    assert prose in prompt.text and prompt.id.startswith("translate-a.1-")
    assert any(lang in prompt.text for lang in train_sources.TRANSLATE_INTO)


def test_a_source_that_is_neither_built_nor_a_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"^data.val_sources: 'sharegtp' is neither a built"):
        iter_training_prompts(["sharegtp"], 0, field="data.val_sources")


def test_built_training_sources_never_overlap_the_evaluation_prompts(default_eval):
    prompts, _ = default_eval
    eval_hashes = {p.content_hash for p in prompts}
    names = {p.id.split(".")[-2] for p in iter_training_prompts(["code"], 0)}
    assert len(names) > 1000 and names.isdisjoint(eval_sources.humaneval_entry_points())
    for source in ("code", "translation"):
        drawn = islice(iter_training_prompts([source], 0), 2000)
        hashes = {p.content_hash for p in drawn}
        assert len(hashes) > 1500 and eval_hashes.isdisjoint(hashes), source
