"""Prefill benchmark: our Llama's prefill on the real target, the causal kernel against the
explicit mask, side by side: one long prompt, and the evaluation's own ragged batches.

    python -m benchmarks.prefill [--profile P] [--lengths 1024 4096 8000] [--repeats 2]
                                  [--eval-batches N]

A prefill from position 0 over whole rows takes SDPA's causal kernel (no mask); any other call
builds an explicit [B, T, span] mask. The `mask` column runs the same prompt with one padding
column appended and `Llama.ragged_causal` off, which is exactly what sends a call down the mask
path (the padded token is packed out of the projections and MLPs, so only the attention's path
differs). The two run in
turn, A B A B, and each figure is the median of `--repeats`.

`--eval-batches N` also prefills the first N batches of short prompts that the evaluate stage
records (the profile's seeded selection from artifacts/prompts/eval.jsonl, batched as the stage
batches them: rows of 50 to 1,900 tokens, padded to the longest). `ragged` attends row by row on
the causal kernel (what the decoder does); `mask` is the one explicit mask over the batch
(`Llama.ragged_causal = False`). Needs the provision stage's artifacts/target, or `--target`
(or materializes the profile's target into a temporary folder). Prints tables; writes
metrics/studies/prefill.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dspark.config import LONG_CATEGORIES, Params, load_params
from dspark.data.prompts import read_prompt_file
from dspark.decode.llama import Llama
from dspark.evaluate.stage import batches, select_prompts
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, materialize, set_threads

ROOT = Path(__file__).resolve().parents[1]


def prefill_s(model: Llama, ids: torch.Tensor, pad: bool) -> tuple[float, torch.Tensor]:
    """Seconds for one prefill of ids [1, T] and its last logits; `pad` adds a padding column."""
    t = ids.shape[1]
    tokens, positions = ids, torch.arange(t)[None]
    valid = torch.ones(1, t, dtype=torch.bool)
    if pad:
        tokens = torch.cat([ids, ids[:, :1]], 1)
        positions = torch.arange(t + 1)[None]
        valid = torch.cat([valid, torch.zeros(1, 1, dtype=torch.bool)], 1)
    model.ragged_causal = not pad  # else a padded row is a ragged prefill: causal again
    cache = model.new_cache(1, t + 1)
    t0 = time.perf_counter()
    logits, _ = model(tokens, positions, cache, valid, logits_at=torch.tensor([[t - 1]]))
    return time.perf_counter() - t0, logits[0, 0]


def batch_prefill_s(
    model: Llama, rows: list[list[int]], ragged: bool
) -> tuple[float, torch.Tensor]:
    """Seconds for one prefill of a padded batch and each row's last logits [B, V]."""
    lengths = torch.tensor([len(r) for r in rows])
    b, t = len(rows), int(lengths.max())
    tokens = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    positions = torch.arange(t).expand(b, t)
    valid = positions < lengths[:, None]
    model.ragged_causal = ragged
    cache = model.new_cache(b, t + 1)
    t0 = time.perf_counter()
    logits, _ = model(tokens, positions, cache, valid, logits_at=(lengths - 1)[:, None])
    return time.perf_counter() - t0, logits[:, 0]


def eval_batches(params: Params, target, count: int) -> list[list[list[int]]]:
    """The first `count` batches of short prompts the evaluate stage records, as token ids."""
    cfg = params.evaluate
    source = ROOT / "artifacts" / "prompts" / "eval.jsonl"
    if not source.is_file():
        raise SystemExit(f"--eval-batches: {source} is missing (run `dvc repro prepare` first)")
    selected = select_prompts(
        read_prompt_file(source), cfg.prompts_per_category, cfg.long_prompts_per_case, cfg.seed
    )
    short = [p for c, ps in selected.items() if c not in LONG_CATEGORIES for p in ps]
    ids = {p.id: target.chat_ids(list(p.messages)) for p in short}
    length = {k: len(v) for k, v in ids.items()}
    return [
        [ids[p.id] for p in b] for b in batches(short, cfg.batch_size, cfg.max_new_tokens, length)
    ][:count]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eval-batches", type=int, default=0)
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "prefill.json")
    args = ap.parse_args(argv)
    params = load_params(ROOT / "params.yaml", args.profile)
    threads = set_threads(None)
    target_dir = args.target
    with tempfile.TemporaryDirectory() as tmp:
        if not target_dir.exists():
            target_dir = Path(tmp) / "target"
            materialize(params.target, target_dir)
        target = load_target_for(params.target, target_dir)
    model = Llama.from_hf(target.model)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        if length + 1 > target.max_context:
            raise SystemExit(f"--lengths: {length} exceeds the target's {target.max_context}")
        ids = torch.randint(0, target.vocab_size, (1, length), generator=gen)
        times: dict[str, list[float]] = {"causal": [], "mask": []}
        last: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name in times:
                s, last[name] = prefill_s(model, ids, pad=name == "mask")
                times[name].append(s)
        causal, mask = (statistics.median(times[k]) for k in ("causal", "mask"))
        rows.append(
            {
                "tokens": length,
                "causal_s": round(causal, 3),
                "mask_s": round(mask, 3),
                "speedup": round(mask / causal, 3),
                "max_logit_diff": float((last["causal"] - last["mask"]).abs().max()),
                "runs_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
            }
        )
    print(f"{'tokens':>7} {'causal s':>9} {'mask s':>8} {'mask/causal':>12} {'max |dlogit|':>13}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['causal_s']:>9.2f} {r['mask_s']:>8.2f} {r['speedup']:>12.2f}"
            f" {r['max_logit_diff']:>13.2e}"
        )
    ragged_rows = []
    for rows_ids in eval_batches(params, target, args.eval_batches) if args.eval_batches else []:
        times = {"ragged": [], "mask": []}
        for _ in range(args.repeats):
            for name in times:
                s, last[name] = batch_prefill_s(model, rows_ids, ragged=name == "ragged")
                times[name].append(s)
        ragged, mask = (statistics.median(times[k]) for k in ("ragged", "mask"))
        lengths = [len(r) for r in rows_ids]
        ragged_rows.append(
            {
                "rows": len(rows_ids),
                "tokens": sum(lengths),
                "shortest": min(lengths),
                "longest": max(lengths),
                "ragged_s": round(ragged, 3),
                "mask_s": round(mask, 3),
                "speedup": round(mask / ragged, 3),
                "max_logit_diff": float((last["ragged"] - last["mask"]).abs().max()),
                "runs_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
            }
        )
    model.ragged_causal = True
    if ragged_rows:
        print(
            f"{'rows':>5} {'tokens':>7} {'lengths':>11} {'ragged s':>9} {'mask s':>8}"
            f" {'mask/ragged':>12} {'max |dlogit|':>13}"
        )
        for r in ragged_rows:
            span = f"{r['shortest']}-{r['longest']}"
            print(
                f"{r['rows']:>5} {r['tokens']:>7} {span:>11} {r['ragged_s']:>9.2f}"
                f" {r['mask_s']:>8.2f} {r['speedup']:>12.2f} {r['max_logit_diff']:>13.2e}"
            )
    write_metrics(
        args.out,
        params.profile,
        {
            "target": target.name,
            "cpu": cpu_features(),
            "threads": threads,
            "repeats": args.repeats,
            "rows": rows,
            "eval_batches": ragged_rows,
        },
    )
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
