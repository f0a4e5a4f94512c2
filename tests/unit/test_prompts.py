import json

import pytest

from dspark.data.prompts import content_hash, read_prompt_file
from dspark.errors import DataError


def jsonl(tmp_path, *rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_both_forms_are_read(tmp_path):
    path = jsonl(
        tmp_path,
        {"category": "qa", "prompt": "Why is the sky blue?"},
        {
            "category": "writing",
            "id": "w1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "A haiku about rain."},
            ],
        },
    )
    first, second = read_prompt_file(path)
    assert first.messages == ({"role": "user", "content": "Why is the sky blue?"},)
    assert second.id == "w1" and second.messages[0]["role"] == "system"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"category": "qa", "prompt": "x"', "prompts.jsonl:2: malformed JSON"),
        ({"category": "poetry", "prompt": "x"}, "prompts.jsonl:2: unknown category 'poetry'"),
        ({"category": "qa"}, "prompts.jsonl:2: give exactly one of"),
        ({"category": "qa", "prompt": ""}, "prompts.jsonl:2: 'prompt' must be"),
        (
            {"category": "qa", "messages": [{"role": "bot", "content": "x"}]},
            r"prompts.jsonl:2: messages\[0\].role",
        ),
        (
            {
                "category": "qa",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ],
            },
            "last message must be the user's",
        ),
        ({"category": "qa", "prompt": "x", "answer": "y"}, "unknown field"),
    ],
)
def test_bad_lines_are_reported_with_their_number(tmp_path, row, message):
    path = jsonl(tmp_path, {"category": "qa", "prompt": "fine"}, row)
    with pytest.raises(DataError, match=message):
        read_prompt_file(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such prompt file"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        read_prompt_file(tmp_path / "empty.jsonl")


def test_content_hash_ignores_case_and_spacing():
    assert content_hash("Hello   World\n") == content_hash("hello world")
    assert content_hash("hello world") != content_hash("hello, world")
