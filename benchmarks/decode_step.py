"""Decode-step benchmark: the target's one-token step, process by process, with and without
transparent huge pages for torch's CPU allocations.

    python -m benchmarks.decode_step [--processes 3] [--rows 1 8] [--context 300] [--steps 40]

A decode step reads every weight once (540 MB for SmolLM2 in fp32), so its time depends on how
the weights sit in memory, and that is fixed when a process loads them: two processes running
the same step can differ by 20% or more. Each measurement is therefore a fresh process, and
the figure per setting is spread over `--processes` of them, the settings alternating (off, on,
off, on, ...). `THP_MEM_ALLOC_ENABLE=1` asks torch's CPU allocator to back allocations of 2 MB
and more with huge pages (madvise), which this machine's kernel grants on request. Needs the
provision stage's artifacts/target (or `--target`). Prints a table and writes
metrics/studies/decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dspark.config import load_params
from dspark.decode.llama import Llama
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, set_threads
from dspark.pipeline import TARGET_DIR

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"4K pages": "0", "huge pages": "1"}
WARM_STEPS = 2  # the first steps of a process warm up and are not counted


def one_process(target_dir: Path, rows: list[int], context: int, steps: int) -> dict[int, float]:
    """In this process: median ms of a one-token step at each row count."""
    params = load_params(ROOT / "params.yaml")
    set_threads(None)
    target = load_target_for(params.target, target_dir)
    model = Llama.from_hf(target.model)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for b in rows:
        cache = model.new_cache(b, context + steps + 1)
        prompt = torch.randint(0, target.vocab_size, (b, context), generator=gen)
        first = torch.zeros(b, 1, dtype=torch.long)  # the prefill's logits are not needed
        model(prompt, torch.arange(context).expand(b, context), cache, logits_at=first)
        times = []
        for i in range(steps):
            token = torch.randint(0, target.vocab_size, (b, 1), generator=gen)
            t0 = time.perf_counter()
            model(token, torch.full((b, 1), context + i), cache)
            times.append(time.perf_counter() - t0)
        out[b] = round(1000 * statistics.median(times[WARM_STEPS:]), 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per setting")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--target", type=Path, default=ROOT / TARGET_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "decode_step.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps <= WARM_STEPS:
        ap.error(f"--steps: {args.steps} leaves none to time (the first {WARM_STEPS} warm up)")
    if args.child:
        print(json.dumps(one_process(args.target, args.rows, args.context, args.steps)))
        return
    if not args.target.exists():
        raise SystemExit(f"{args.target}: missing (run `dspark provision` first)")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    child = [sys.executable, "-m", "benchmarks.decode_step", "--child", "--rows"]
    child += [str(b) for b in args.rows] + ["--context", str(args.context)]
    child += ["--steps", str(args.steps), "--target", str(args.target)]
    for _ in range(args.processes):
        for name, flag in SETTINGS.items():
            env = {**os.environ, "THP_MEM_ALLOC_ENABLE": flag}
            done = subprocess.run(child, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(
                    f"benchmarks.decode_step: a measuring process failed:\n{done.stderr}"
                )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = []
    for b in args.rows:
        row: dict[str, object] = {"rows": b}
        for name in SETTINGS:
            ms = [r[str(b)] for r in runs[name]]
            row[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        off, on = (row[name]["median_ms"] for name in SETTINGS)  # type: ignore[index]
        row["speedup"] = round(off / on, 3)
        table.append(row)
    print(f"{'rows':>4} {'setting':>10} {'median ms':>10} {'min':>7} {'max':>7}")
    for row in table:
        for name in SETTINGS:
            r = row[name]
            print(
                f"{row['rows']:>4} {name:>10} {r['median_ms']:>10.1f} {r['min_ms']:>7.1f}"
                f" {r['max_ms']:>7.1f}"
            )
        print(f"{'':>4} {'4K / huge':>10} {row['speedup']:>10.2f}")
    doc = {
        "cpu": cpu_features(),
        "context": args.context,
        "steps": args.steps,
        "processes": args.processes,
        "rows": table,
        "runs": runs,
    }
    write_metrics(args.out, load_params(ROOT / "params.yaml").profile, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
