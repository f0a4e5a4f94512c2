"""Training-step benchmark: where a step's time goes, and what the target's cached top-k saves.

    python -m benchmarks.train_step [--profile P] [--batches 6] [--k 64]

Reads the extract stage's shards (artifacts/hidden) and the trainer's own drafts as
`train.*` configures them. Each batch is collated two ways, in turn, and every draft takes one
optimizer step on each, in turn, so the two paths run side by side in one process:

  topk     the target's top-k (the shards' own when they carry it, else computed here from
           last_hidden exactly as the producers compute it), kept sparse: [B, S, k]
  lm_head  the lm_head rebuild that shards without top-k need: a full-vocabulary matmul and
           softmax per supervised position, dense over the draft vocabulary: [B, S, d]

A draft's tokens/s is counted as the trainer counts it: the batch's tokens over its step plus
the whole collate. The first batch warms up and is not counted.

It also says what the top-k costs in fidelity, over every supervised position of the timed
batches: the target's mass beyond the k, the total-variation distance between the two targets
over the draft vocabulary, and how often their argmax (the CE label) differs. Prints a table and
writes metrics/studies/train_step.json.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark.config import load_params
from dspark.extract.capture import resolve_aux_layers, topk_logprobs
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, set_threads
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.schema import Sample
from dspark.train.batch import TargetHead, collate
from dspark.train.sources import HiddenShards
from dspark.train.stage import build_runs, resolve_mask_token

ROOT = Path(__file__).resolve().parents[1]


def with_topk(sample: Sample, head: TargetHead, k: int) -> Sample:
    """The sample carrying the target's top-k at its supervised positions (its own if it has
    them), as a producer with `extract.target_topk: k` writes it."""
    if sample.target_logprobs is not None:
        return sample
    last = sample.last_hidden[sample.supervised].to(torch.float32)
    logprobs, ids = topk_logprobs(head.lm_head(head.norm(last)), k)
    return replace(sample, target_logprobs=logprobs, target_ids=ids).validate()


def without_topk(sample: Sample) -> Sample:
    return replace(sample, target_logprobs=None, target_ids=None)


def timed_collate(samples: list[Sample], head: TargetHead):
    t0 = time.perf_counter()
    batch = collate(samples, head)
    return batch, time.perf_counter() - t0


def fidelity(pairs: list[tuple]) -> dict:
    """How far the top-k batches' targets are from the lm_head's, over every supervised
    position of (exact batch, top-k batch, top-k samples) triples."""
    tails, tvs, differs = [], [], []
    for exact, approx, samples in pairs:
        valid = exact.labels >= 0
        p = exact.p_target[valid]  # [N, d]
        q = approx.dense_p(p.shape[-1])[valid]
        tails.append(torch.cat([1 - s.target_logprobs.exp().sum(-1) for s in samples]))
        tvs.append(0.5 * (p - q).abs().sum(-1))
        differs.append(exact.labels[valid] != approx.labels[valid])
    tail, tv, differ = torch.cat(tails), torch.cat(tvs), torch.cat(differs)
    return {
        "positions": int(tv.numel()),
        "tail_mass_mean": round(float(tail.mean()), 5),
        "tail_mass_p99": round(float(tail.quantile(0.99)), 5),
        "tv_mean": round(float(tv.mean()), 5),
        "tv_max": round(float(tv.max()), 5),
        "label_differs": round(float(differ.float().mean()), 5),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--batches", type=int, default=6, help="the first one warms up")
    ap.add_argument("--k", type=int, default=None, help="top-k (default: extract.target_topk)")
    ap.add_argument("--hidden", type=Path, default=ROOT / "artifacts" / "hidden")
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "train_step.json")
    args = ap.parse_args(argv)
    params = load_params(ROOT / "params.yaml", args.profile)
    k = args.k or params.extract.target_topk
    if k <= 0:
        raise SystemExit("--k: the top-k must be positive (extract.target_topk is 0)")
    threads = set_threads(None)
    target = load_target_for(params.target, args.target)
    shards = HiddenShards(args.hidden)
    b = params.train.batch_size
    if len(shards.ids) < args.batches * b:
        raise SystemExit(
            f"--batches: {args.hidden} has {len(shards.ids)} samples, fewer than "
            f"{args.batches} batches of {b}"
        )
    samples = list(shards.read(shards.ids))
    counts = count_tokens(iter(samples), target.vocab_size)
    draft_ids = build_draft_ids(counts, params.train.draft_vocab_size, always=[target.eos_token_id])
    head = TargetHead(target.norm, target.lm_head, draft_ids)
    aux = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    mask_id = resolve_mask_token(params.train.dspark.mask_token_id, target, counts)
    runs = build_runs(params, target, draft_ids, aux, mask_id)
    shipped = samples[0].target_logprobs is not None

    modes = ("topk", "lm_head")
    spent = {(mode, part): 0.0 for mode in modes for part in ("collate", *(r.name for r in runs))}
    tokens, stats = 0, []
    for i in range(args.batches):
        rows = samples[i * b : (i + 1) * b]
        topk_rows = [with_topk(s, head, k) for s in rows]
        approx, topk_s = timed_collate(topk_rows, head)
        exact, exact_s = timed_collate([without_topk(s) for s in rows], head)
        took = {("topk", "collate"): topk_s, ("lm_head", "collate"): exact_s}
        for run in runs:
            for mode, batch in (("topk", approx), ("lm_head", exact)):
                t0 = time.perf_counter()
                run.step(batch, i, args.batches, params.train.seed, 0.0)
                took[mode, run.name] = time.perf_counter() - t0
        if i == 0:
            continue
        tokens += approx.tokens
        for key, sec in took.items():
            spent[key] += sec
        stats.append((exact, approx, topk_rows))

    timed = args.batches - 1
    drafts = [r.name for r in runs]

    def rate(mode: str, parts: list[str]) -> float:
        return round(tokens / sum(spent[mode, p] for p in parts), 1)

    doc = {
        "target": target.name,
        "cpu": cpu_features(),
        "threads": threads,
        "k": k,
        "topk_from_shards": shipped,
        "batch_size": b,
        "timed_batches": timed,
        "tokens_per_batch": round(tokens / timed, 1),
        "seconds_per_batch": {
            mode: {part: round(spent[mode, part] / timed, 3) for part in ("collate", *drafts)}
            for mode in modes
        },
        # each draft's step plus the whole collate, as the trainer counts it
        "draft_tokens_per_s": {
            mode: {d: rate(mode, ["collate", d]) for d in drafts} for mode in modes
        },
        # one collate and every draft's step: the training loop's rate
        "loop_tokens_per_s": {mode: rate(mode, ["collate", *drafts]) for mode in modes},
        "fidelity": fidelity(stats),
    }
    sec = doc["seconds_per_batch"]
    print(f"batch {b}, {doc['tokens_per_batch']} tokens per batch, {timed} timed batches, k={k}")
    steps_head = " ".join(f"{d + ' step s':>13}" for d in drafts)
    rates_head = " ".join(f"{d + ' tok/s':>13}" for d in drafts)
    print(f"{'':>8} {'collate s':>10} {steps_head} {rates_head} {'loop tok/s':>11}")
    for mode in modes:
        steps = " ".join(f"{sec[mode][d]:>13.3f}" for d in drafts)
        rates = " ".join(f"{doc['draft_tokens_per_s'][mode][d]:>13.1f}" for d in drafts)
        print(
            f"{mode:>8} {sec[mode]['collate']:>10.3f} {steps} {rates}"
            f" {doc['loop_tokens_per_s'][mode]:>11.1f}"
        )
    f = doc["fidelity"]
    print(
        f"top-k fidelity over {f['positions']} positions: tail mass mean {f['tail_mass_mean']:.4f}"
        f" (p99 {f['tail_mass_p99']:.4f}), TV mean {f['tv_mean']:.4f} (max {f['tv_max']:.4f}),"
        f" label differs {f['label_differs']:.4%}"
    )
    write_metrics(args.out, params.profile, doc)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
