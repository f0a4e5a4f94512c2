"""The prepare stage: evaluation prompt set, then on-policy training shards.

1. Build the evaluation prompts of every category and write them (the evaluate stage reads them).
2. Walk the training sources (after the validation split's, if `data.val_sources` names any),
   drop any prompt whose content hash is an evaluation or validation prompt's, apply the chat
   template, and skip prompts longer than `prepare.max_prompt_tokens`.
3. Shard by shard: the target regenerates `regenerate_fraction` of the answers (batched, with
   the generator `prepare.engine` picks in `generators.py`), the rest keep the dataset's answer;
   the loss mask covers the response tokens only.
Finished shards are skipped on a rerun, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

import torch

from dspark.config import Params
from dspark.data import shards as shard_io
from dspark.data.eval_sources import build_eval_prompts
from dspark.data.generators import GenerateFn, GeneratorSetup, open_generator
from dspark.data.prompts import Prompt, read_prompt_file, write_prompt_file
from dspark.data.train_sources import interleave, source_streams
from dspark.errors import DataError
from dspark.io import ensure_writable_dir, write_text
from dspark.metrics import EventLog
from dspark.models.target import Target, read_manifest
from dspark.progress import bar as progress_bar


@dataclass(frozen=True)
class PreparePaths:
    target: Path
    shards: Path
    eval_prompts: Path
    events: Path | None = None
    lengths_plot: Path | None = None  # CSV: sample_id, prompt_tokens, response_tokens
    vllm_log: Path | None = None  # the vllm generator's server log
    vllm_venv: Path | None = None  # the vllm generator's venv (default: ./.venv-vllm)


def long_context_tokens(params: Params, target: Target) -> int:
    """As long as the target's context allows after the chat template, max_new_tokens and one
    draft block (the text's own count leaves out the template's tokens around it)."""
    if params.data.long_context_tokens:
        return params.data.long_context_tokens
    template = len(target.chat_ids([{"role": "user", "content": ""}]))
    reserve = params.evaluate.max_new_tokens["long_context"] + params.train.dspark.block_size
    return target.max_context - reserve - template


def build_eval_set(params: Params, target: Target, user_file: Path | None = None) -> list[Prompt]:
    if user_file is not None:
        return read_prompt_file(user_file)

    def count(text: str) -> int:
        return len(target.tokenizer(text, add_special_tokens=False)["input_ids"])

    return build_eval_prompts(
        params.data.eval_counts,
        params.data.seed,
        count_tokens=count,
        long_context_tokens=long_context_tokens(params, target),
    )


def _regenerates(seed: int, prompt_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"regen:{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass
class _Candidate:
    prompt: Prompt
    prompt_ids: list[int]
    source: str = ""  # its entry in data.train_sources or data.val_sources


def _candidates(
    params: Params,
    target: Target,
    prompts: Iterator[Prompt],
    banned: dict[str, str],
    stats: dict,
    seen: set[str],
) -> Iterator[_Candidate]:
    """Usable prompts; `banned` maps a content hash to the stat that counts its skips."""
    for prompt in prompts:
        h = prompt.content_hash
        if h in banned:
            stats[banned[h]] += 1
            continue
        if h in seen:
            stats["skipped_duplicate"] += 1
            continue
        seen.add(h)
        ids = target.chat_ids(list(prompt.messages))
        if len(ids) > params.prepare.max_prompt_tokens:
            stats["skipped_too_long"] += 1
            continue
        yield _Candidate(prompt, ids)


def _mixed_candidates(
    params: Params,
    target: Target,
    sources: list[str],
    weights: list[float] | None,
    field: str,
    banned: dict[str, str],
    stats: dict,
) -> Iterator[_Candidate]:
    """Each source's usable prompts, interleaved by weight: the weights are shares of what is
    kept, whatever each source loses to the length cap or the eval set."""
    seen: set[str] = set()
    streams = source_streams(sources, params.data.seed, field)
    usable = [
        _labelled(_candidates(params, target, stream, banned, stats, seen), name)
        for stream, name in zip(streams, sources, strict=True)
    ]
    return interleave(usable, weights or [1.0] * len(usable))


def _labelled(candidates: Iterator[_Candidate], source: str) -> Iterator[_Candidate]:
    for c in candidates:
        c.source = source
        yield c


def _validation_split(
    params: Params, target: Target, banned: dict[str, str], stats: dict
) -> list[_Candidate]:
    """With `data.val_sources`, the first `train.eval_samples` samples are drawn from them (the
    train stage holds out the lowest ids), so runs that train on different sources are judged
    on the same prompts; none of them is trained on. Without it, the empty list."""
    data, count = params.data, params.train.eval_samples
    if not data.val_sources or not count:
        return []
    usable = _mixed_candidates(
        params, target, data.val_sources, None, "data.val_sources", banned, stats
    )
    held_out = list(islice(usable, count))
    if len(held_out) < count:
        raise DataError(
            f"data.val_sources: {len(held_out)} usable prompts for train.eval_samples {count}"
        )
    return held_out


def _responses(
    params: Params, target: Target, generate: GenerateFn, batch: list[_Candidate], shard: int
) -> tuple[list[list[int]], int]:
    """Responses in batch order, and how many were regenerated."""
    cfg = params.prepare
    regen = [
        i
        for i, c in enumerate(batch)
        if c.prompt.reference is None
        or _regenerates(cfg.seed, c.prompt.id, cfg.regenerate_fraction)
    ]
    out: list[list[int] | None] = [None] * len(batch)
    # Similar lengths together: less left padding per generate call.
    regen.sort(key=lambda i: len(batch[i].prompt_ids))
    for start in range(0, len(regen), cfg.batch_size):
        rows = regen[start : start + cfg.batch_size]
        generated = generate(
            [batch[i].prompt_ids for i in rows],
            max_new_tokens=cfg.max_new_tokens,
            sampling=cfg.sampling,
            seed=cfg.seed * 100_003 + shard * 1009 + start,
        )
        for i, ids in zip(rows, generated, strict=True):
            out[i] = ids
    for i, c in enumerate(batch):
        if out[i] is None:
            kept = target.tokenizer(c.prompt.reference, add_special_tokens=False)["input_ids"]
            out[i] = [*kept[: cfg.max_new_tokens - 1], target.eos_token_id]
    return out, len(regen)  # type: ignore[return-value]


def prepare_stage(
    params: Params,
    target: Target,
    paths: PreparePaths,
    *,
    eval_file: Path | None = None,
    progress: bool = True,
) -> dict:
    """Run the stage; return its metrics."""
    cfg = params.prepare
    t0 = time.perf_counter()
    ensure_writable_dir(paths.shards)
    eval_prompts = build_eval_set(params, target, eval_file)
    write_prompt_file(paths.eval_prompts, eval_prompts)
    keys = ("skipped_eval_overlap", "skipped_validation", "skipped_duplicate", "skipped_too_long")
    stats = dict.fromkeys(keys, 0)  # counted as the candidates are drawn
    held_out, candidates = _training_candidates(params, target, eval_prompts, stats)
    events = EventLog(paths.events)
    fingerprint = _fingerprint(params, paths.target)
    bar = progress_bar(total=cfg.num_samples, desc="prepare", unit="sample", enabled=progress)
    setup = GeneratorSetup(
        target=target,
        target_dir=paths.target,
        max_len=min(cfg.max_prompt_tokens + cfg.max_new_tokens, target.max_context),
        batch=cfg.batch_size,
        venv=paths.vllm_venv,
        log=paths.vllm_log,
    )
    with open_generator(cfg.engine, setup) as generate:
        written = _write_shards(
            params,
            target,
            generate,
            candidates,
            folder=paths.shards,
            fingerprint=fingerprint,
            bar=bar,
            events=events,
        )
    bar.close()
    if not written.entries:
        raise DataError("data.train_sources: no usable training prompts")
    _drop_stale_shards(paths.shards, len(written.entries))
    manifest = _write_shard_manifest(paths, written.entries, len(eval_prompts), held_out)
    if paths.lengths_plot:
        _write_lengths(paths.lengths_plot, paths.shards)
    gen_tokens, gen_seconds = written.gen_tokens, written.gen_seconds
    return {
        "num_samples": manifest["num_samples"],
        "num_tokens": manifest["num_tokens"],
        "response_tokens": manifest["response_tokens"],
        "regenerated": manifest["regenerated"],
        "kept_from_dataset": manifest["num_samples"] - manifest["regenerated"],
        "reused_shards": written.reused_shards,
        "eval_prompts": len(eval_prompts),
        **stats,
        # None with the `extract` generator: the extract stage answers, and measures it.
        "gen_tok_s": round(gen_tokens / gen_seconds, 2) if gen_tokens else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _training_candidates(
    params: Params, target: Target, eval_prompts: list[Prompt], stats: dict
) -> tuple[list[_Candidate], Iterator[_Candidate]]:
    """The validation split, and the prompts to shard: the split first, then the training
    sources' prompts, none of them an evaluation or validation prompt."""
    banned = dict.fromkeys((p.content_hash for p in eval_prompts), "skipped_eval_overlap")
    held_out = _validation_split(params, target, banned, stats)
    banned.update(dict.fromkeys((c.prompt.content_hash for c in held_out), "skipped_validation"))
    data = params.data
    to_train = _mixed_candidates(
        params, target, data.train_sources, data.train_weights, "data.train_sources", banned, stats
    )
    candidates = chain(held_out, to_train)
    if params.prepare.num_samples and params.prepare.token_budget is None:
        candidates = _drawn_up_front(params, candidates, stats)
    return held_out, candidates


def _drawn_up_front(
    params: Params, candidates: Iterator[_Candidate], stats: dict
) -> Iterator[_Candidate]:
    """The first `prepare.num_samples` candidates, or a DataError if there are fewer."""
    cfg = params.prepare
    # Count before generating: a shortfall found after hours of answers would waste them.
    wanted = list(islice(candidates, cfg.num_samples))
    if len(wanted) < cfg.num_samples:
        raise DataError(
            f"prepare.num_samples: {cfg.num_samples} asked, data.train_sources give "
            f"{len(wanted)} usable prompts ({stats['skipped_too_long']} longer than "
            f"prepare.max_prompt_tokens, {stats['skipped_duplicate']} duplicates, "
            f"{stats['skipped_eval_overlap']} in the eval set)"
        )
    return iter(wanted)


@dataclass
class _WrittenShards:
    entries: list[dict] = field(default_factory=list)  # the manifest's, in shard order
    reused_shards: int = 0  # finished by an earlier run
    gen_tokens: int = 0  # response tokens of the shards this run wrote
    gen_seconds: float = 0.0


def _write_shards(
    params: Params,
    target: Target,
    generate: GenerateFn,
    candidates: Iterator[_Candidate],
    *,
    folder: Path,
    fingerprint: str,
    bar: Any,
    events: EventLog,
) -> _WrittenShards:
    """Shard by shard until `prepare.num_samples` or `prepare.token_budget` is reached or the
    candidates run out; a shard an earlier run finished for the same batch is kept."""
    cfg = params.prepare
    written = _WrittenShards()
    sample_id = tokens = 0
    target_n = cfg.num_samples or 10**12
    while sample_id < target_n and (cfg.token_budget is None or tokens < cfg.token_budget):
        want = min(cfg.shard_size, target_n - sample_id)
        batch = [c for _, c in zip(range(want), candidates, strict=False)]
        if not batch:
            break
        index = len(written.entries)
        path = folder / shard_io.shard_name(index)
        entry = _finished_shard(path, batch, sample_id, fingerprint)
        if entry is not None:
            written.reused_shards += 1
        else:
            entry = _generate_shard(
                params,
                target,
                generate,
                batch,
                path=path,
                index=index,
                first_id=sample_id,
                fingerprint=fingerprint,
                written=written,
            )
        written.entries.append(entry)
        sample_id += entry["samples"]
        tokens += entry["tokens"]
        bar.update(entry["samples"])
        gen_tokens, gen_seconds = written.gen_tokens, written.gen_seconds
        events.log(
            index,
            samples=sample_id,
            tokens=tokens,
            gen_tok_s=gen_tokens / gen_seconds if gen_tokens else 0.0,
        )
    return written


def _generate_shard(
    params: Params,
    target: Target,
    generate: GenerateFn,
    batch: list[_Candidate],
    *,
    path: Path,
    index: int,
    first_id: int,
    fingerprint: str,
    written: _WrittenShards,
) -> dict:
    """Answer `batch` and write it as shard `index`; return its manifest entry. The answers'
    tokens and the generation's seconds add to `written`."""
    t_gen = time.perf_counter()
    responses, n_regen = _responses(params, target, generate, batch, index)
    written.gen_seconds += time.perf_counter() - t_gen
    samples = []
    for offset, (c, response) in enumerate(zip(batch, responses, strict=True)):
        samples.append(_token_sample(first_id + offset, c, response))
        written.gen_tokens += len(response)
    return shard_io.write_shard(path, samples, regenerated=n_regen, fingerprint=fingerprint)


def _token_sample(sample_id: int, c: _Candidate, response: list[int]) -> shard_io.TokenSample:
    """Prompt and response as one sequence; the loss mask covers the response tokens only."""
    ids = torch.tensor(c.prompt_ids + response, dtype=torch.int32)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[len(c.prompt_ids) :] = True
    return shard_io.TokenSample(sample_id, c.prompt.id, ids, mask)


def _write_shard_manifest(
    paths: PreparePaths, entries: list[dict], eval_prompts: int, held_out: list[_Candidate]
) -> dict:
    """The token shards' manifest: the shards' entries and where their prompts came from."""
    return shard_io.write_manifest(
        paths.shards,
        entries,
        {
            "target": read_manifest(paths.target).get("source"),
            "eval_prompts": eval_prompts,
            "chat_template": "target",
            # The train stage checks it holds out exactly these (train.eval_samples).
            "validation_samples": len(held_out) if held_out else None,
            "validation_sources": [c.source for c in held_out] if held_out else None,
        },
    )


def _write_lengths(path: Path, folder: Path) -> None:
    rows = ["sample_id,prompt_tokens,response_tokens"]
    for s in shard_io.iter_samples(folder, verify=False):
        response = int(s.loss_mask.sum())
        rows.append(f"{s.sample_id},{s.input_ids.numel() - response},{response}")
    write_text(path, "\n".join(rows) + "\n")


def _fingerprint(params: Params, target_dir: Path) -> str:
    """What a shard's content depends on besides its prompts: a changed param redoes it."""
    basis = {
        "prepare": params.prepare.model_dump(),
        "data": params.data.model_dump(),
        "validation_samples": params.train.eval_samples if params.data.val_sources else None,
        "target": read_manifest(target_dir),
    }
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def _finished_shard(
    path: Path, batch: list[_Candidate], first_id: int, fingerprint: str
) -> dict | None:
    """The manifest entry of a shard an earlier run finished for exactly this batch, if any."""
    if not path.exists():
        return None
    try:
        entry = shard_io.shard_entry(path)
        prompt_ids = [s.prompt_id for s in shard_io.read_shard(path)]
    except DataError:
        return None
    if (
        prompt_ids != [c.prompt.id for c in batch]
        or entry["first_sample_id"] != first_id
        or entry["fingerprint"] != fingerprint
    ):
        return None
    return entry


def _drop_stale_shards(folder: Path, keep: int) -> None:
    """Shards past the end of this run (left by a larger earlier run) are not part of it."""
    for path in folder.glob("shard-*.safetensors"):
        if int(path.stem.split("-")[1]) >= keep:
            path.unlink()
