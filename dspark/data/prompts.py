"""Prompts: what every source yields, the user JSONL format, and content hashes.

A user file has one JSON object a line, either
    {"category": "qa", "prompt": "What is ...?"}
or  {"category": "qa", "messages": [{"role": "user", "content": "..."}, ...]}
with optional "id" and "source". Bad lines are reported with their line number.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dspark.config import CATEGORIES, LONG_CATEGORIES
from dspark.errors import DataError
from dspark.io import write_text

ROLES = ("system", "user", "assistant")
KNOWN_CATEGORIES = (*CATEGORIES, *LONG_CATEGORIES)


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...]  # chat messages; the last one is the user's turn
    source: str = ""
    reference: str | None = field(default=None, compare=False)  # a dataset answer, if any

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] != "assistant")

    @property
    def content_hash(self) -> str:
        return content_hash(self.text)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "category": self.category,
            "messages": list(self.messages),
            "source": self.source,
        }


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def content_hash(text: str) -> str:
    """Whitespace- and case-insensitive SHA-256: the key that keeps train and eval apart."""
    return hashlib.sha256(normalize(text).encode()).hexdigest()


def user(content: str, system: str | None = None) -> tuple[dict, ...]:
    turns = ({"role": "system", "content": system},) if system else ()
    return (*turns, {"role": "user", "content": content})


def parse_prompt_line(obj: object, where: str, categories: Iterable[str] | None) -> Prompt:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    category = obj.get("category")
    allowed = tuple(categories) if categories is not None else None
    if not isinstance(category, str) or not category:
        raise DataError(f"{where}: 'category' must be a non-empty string")
    if allowed is not None and category not in allowed:
        raise DataError(f"{where}: unknown category {category!r} (known: {', '.join(allowed)})")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise DataError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string")
        messages = user(obj["prompt"])
    else:
        messages = _check_messages(obj["messages"], where)
    extra = set(obj) - {"category", "prompt", "messages", "id", "source"}
    if extra:
        raise DataError(f"{where}: unknown field(s) {sorted(extra)}")
    pid = obj.get("id")
    pid = (
        str(pid) if pid is not None else f"{category}-{content_hash(messages[-1]['content'])[:12]}"
    )
    source = str(obj.get("source") or where.rsplit(":", 1)[0])
    return Prompt(id=pid, category=category, messages=messages, source=source)


def _check_messages(messages: object, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise DataError(f"{where}: the last message must be the user's")
    return tuple(out)


def read_prompt_file(
    path: Path | str, categories: Iterable[str] | None = KNOWN_CATEGORIES
) -> list[Prompt]:
    """Read a user JSONL prompt file; any bad line raises DataError naming file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such prompt file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg})") from None
        prompts.append(parse_prompt_line(obj, where, categories))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def write_prompt_file(path: Path, prompts: Iterable[Prompt]) -> None:
    write_text(path, "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in prompts))
