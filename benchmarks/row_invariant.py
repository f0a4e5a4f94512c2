"""What reproducible extraction costs: the producers' on-policy decoder with and without
row-invariant decoding (dspark/decode/llama.py), side by side on the same prompts.

    python -m benchmarks.row_invariant [--prompts 64] [--max-new 128] [--rows 64] [--rounds 2]

Each round decodes every prompt both ways, in turn (plain first, then row-invariant, then the
other order in the next round), as one producer does: `--rows` rows continuously batched, one
thread. It reports prompt and response tokens with their states per wall-second, and whether
the two ways gave the same tokens. Prints a table and writes metrics/studies/row_invariant.json.
Run it alone: the two cores are shared.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.onpolicy import prompts_of
from dspark.config import load_params
from dspark.decode.llama import Llama
from dspark.extract.capture import resolve_aux_layers
from dspark.extract.onpolicy import OnPolicyDecoder
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, set_threads

ROOT = Path(__file__).resolve().parents[1]


def decode(llama, target, prompts, rows, max_new, taps, invariant) -> tuple[float, list]:
    dec = OnPolicyDecoder(
        llama,
        target.eos_token_id,
        target.max_context,
        taps,
        rows,
        max(len(p) for p in prompts),
        max_new,
        row_invariant=invariant,
    )
    pending, out = list(enumerate(prompts)), {}
    t0 = time.perf_counter()
    while pending or dec.busy:
        while pending and dec.free:
            dec.admit(*pending.pop(0))
        for a in dec.step():
            out[a.key] = a.input_ids
    return time.perf_counter() - t0, [out[i] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shards", type=Path, default=ROOT / "artifacts" / "shards")
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "row_invariant.json")
    args = ap.parse_args(argv)
    params = load_params(ROOT / "params.yaml")
    set_threads(1)  # as a producer runs
    target = load_target_for(params.target, args.target)
    llama = Llama.from_hf(target.model)
    layers = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    taps = tuple(sorted({*layers, target.num_layers - 1}))
    prompts = prompts_of(args.shards, args.prompts)
    walls = {False: [], True: []}
    answers = {}
    for r in range(args.rounds):
        for invariant in (False, True) if r % 2 == 0 else (True, False):
            wall, out = decode(llama, target, prompts, args.rows, args.max_new, taps, invariant)
            walls[invariant].append(wall)
            answers[invariant] = out
    tokens = sum(len(ids) for ids in answers[True])
    same = sum(a == b for a, b in zip(answers[False], answers[True], strict=True))
    rows = []
    for invariant in (False, True):
        best = min(walls[invariant])
        rows.append(
            {
                "decoding": "row-invariant" if invariant else "plain",
                "tokens": tokens,
                "wall_s": [round(w, 2) for w in walls[invariant]],
                "tok_s_best": round(tokens / best, 1),
            }
        )
    ratio = round(rows[1]["tok_s_best"] / rows[0]["tok_s_best"], 3)
    print(f"{len(prompts)} prompts, {args.max_new} new tokens, {args.rows} rows, 1 thread")
    print(f"{'decoding':<14} {'tokens':>7} {'best tok/s':>11}  wall s per round")
    for r in rows:
        print(f"{r['decoding']:<14} {r['tokens']:>7} {r['tok_s_best']:>11}  {r['wall_s']}")
    print(f"row-invariant / plain: {ratio}; answers identical: {same} of {len(prompts)}")
    payload = {
        "cpu": cpu_features(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new,
        "rows": args.rows,
        "threads": torch.get_num_threads(),
        "runs": rows,
        "ratio_invariant_to_plain": ratio,
        "answers_identical": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_metrics(args.out, params.profile, payload)


if __name__ == "__main__":
    main()
