"""How the target's aux hidden states spread their energy over channels: the measurement behind
`train.dspark.context_scale`.

    python -m evals.feature_scale [--hidden artifacts/hidden] [--samples 64]

Reads the extract stage's hidden-state shards (the first `--samples` samples, every token) and
prints, per aux layer, the median and largest channel RMS and the share of the layer's energy
(sum of squares) held by its five largest channels. Writes metrics/studies/feature_scale.json.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from dspark.metrics import write_metrics
from dspark.transport.files import iter_hidden, read_hidden_manifest

ROOT = Path(__file__).resolve().parents[1]


def channel_table(square_sums: torch.Tensor, count: int, layers: list[int]) -> list[dict]:
    """square_sums [L, H] over `count` tokens -> one row per aux layer."""
    rows = []
    for layer, sq in zip(layers, square_sums, strict=True):
        rms = (sq / count).sqrt().sort(descending=True).values
        rows.append(
            {
                "layer": layer,
                "rms_median": round(float(rms.median()), 3),
                "rms_max": round(float(rms[0]), 1),
                "rms_top5": [round(float(x), 1) for x in rms[:5]],
                "top5_energy_share": round(float(rms[:5].pow(2).sum() / rms.pow(2).sum()), 4),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=Path, default=ROOT / "artifacts" / "hidden")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "feature_scale.json")
    args = ap.parse_args(argv)
    layers = list(read_hidden_manifest(args.hidden)["aux_layers"])
    square_sums, count, n = None, 0, 0
    for sample in itertools.islice(iter_hidden(args.hidden), args.samples):
        aux = sample.aux_hidden.double()  # [L, S, H]
        part = aux.pow(2).sum(1)
        square_sums = part if square_sums is None else square_sums + part
        count += aux.shape[1]
        n += 1
    if square_sums is None:
        raise SystemExit(f"{args.hidden}: no samples")
    rows = channel_table(square_sums, count, layers)
    print(f"{n} samples, {count} tokens, from {args.hidden}")
    print("| aux layer | channel RMS median | largest | 5 largest | their energy share |")
    print("|---|---|---|---|---|")
    for r in rows:
        top = ", ".join(f"{x:,.0f}" for x in r["rms_top5"])
        print(
            f"| {r['layer']} | {r['rms_median']} | {r['rms_max']:,.0f} | {top} "
            f"| {r['top5_energy_share']:.1%} |"
        )
    write_metrics(args.out, "-", {"samples": n, "tokens": count, "layers": rows})


if __name__ == "__main__":
    main()
