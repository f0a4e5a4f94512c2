"""The benchmark's workload: the requests each workload sends (token ids, prompt lengths in the
band) and the cells of the sweep, (concurrency, workload) in the order they are measured."""

from __future__ import annotations

from pathlib import Path

from dspark.config import Params
from dspark.data.prompts import read_prompt_file
from dspark.errors import DataError


def build_requests(params: Params, target, prompts_file: Path) -> dict[str, list[dict]]:
    """Workload name -> requests {id, category, prompt: token ids, text: those ids decoded, for
    a server that takes text only} with prompt lengths in the band. `mix` interleaves the
    categories, so any prefix of it is mixed."""
    cfg = params.benchmark
    lo, hi = cfg.prompt_tokens
    by_cat: dict[str, list[dict]] = {}
    for p in read_prompt_file(prompts_file):
        ids = target.chat_ids(list(p.messages))
        if lo <= len(ids) <= hi:
            # Byte-level BPE decodes exactly: the text tokenizes back to these ids (llama.cpp's
            # tokenizer too: tests/integration/test_llamacpp.py).
            text = target.tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            by_cat.setdefault(p.category, []).append(
                {"id": p.id, "category": p.category, "prompt": ids, "text": text}
            )
    names = {cfg.workload} | ({"mix"} if cfg.mixed_concurrency else set())
    out = {}
    for name in sorted(names):
        if name == "mix":
            queues = [list(v) for _, v in sorted(by_cat.items())]
            mixed = []
            while any(queues):
                mixed.extend(q.pop(0) for q in queues if q)
            out[name] = mixed
        else:
            out[name] = by_cat.get(name, [])
        if not out[name]:
            raise DataError(
                f"{prompts_file}: no {name} prompt of {lo}..{hi} tokens "
                "(benchmark.prompt_tokens, benchmark.workload)"
            )
    return out


def cell_plan(params: Params) -> list[tuple[int, str]]:
    """The sweep's cells: every concurrency on the workload, then the mixed cell, if any."""
    cfg = params.benchmark
    cells = [(c, cfg.workload) for c in cfg.concurrency]
    if cfg.mixed_concurrency:
        cells.append((cfg.mixed_concurrency, "mix"))
    return cells
