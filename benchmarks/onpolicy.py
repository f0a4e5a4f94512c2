"""On-policy data plane benchmark: prompt and response tokens whose aux hidden states are ready for
the trainer, per wall-second, for each way of producing them, side by side on the same prompts.

    python -m benchmarks.onpolicy [--prompts 32] [--max-new 128] [--batches 16,32] \
        [--out metrics/studies/onpolicy.json]

  transformers+capture  today's default path: transformers' batched generate (the prepare
                        stage's `hf` generator), then one forward per sample capturing
                        the aux layers (the extract stage's producer)
  dspark-recorded@B     our batched static-cache decoder decoding B rows at a time and keeping
                        the aux layers' states as the tokens are produced (one pass:
                        dspark.decode.replay.Recorder)

The prompts are those of the profile's prepared shards (`artifacts/shards`, the prompt part of
each sample), responses greedy up to `--max-new`. For each recorded run the largest difference
from a full forward's states on the same tokens (the extract stage's capture) is reported:
states captured step by step must be the states the trainer would otherwise get.

vLLM's CPU server is left out here (its own venv and a minute of start-up); the prepare stage
measures it (metrics/full/prepare.json: 75 generated tok/s, before extraction). Prints a table
and writes JSON. Run it alone: the two cores are shared.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dspark.config import SamplingConfig, load_params
from dspark.data.generate import generate_batch
from dspark.data.shards import TokenSample, iter_samples
from dspark.decode.llama import Llama
from dspark.decode.replay import decode_recorded
from dspark.extract.capture import HiddenStateCapture, resolve_aux_layers
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, set_threads

ROOT = Path(__file__).resolve().parents[1]


def prompts_of(shards: Path, n: int) -> list[list[int]]:
    out = []
    for s in iter_samples(shards):
        cut = (
            int(torch.nonzero(s.loss_mask).flatten()[0])
            if s.loss_mask.any()
            else s.input_ids.numel()
        )
        out.append(s.input_ids[:cut].tolist())
        if len(out) == n:
            break
    return out


def transformers_then_capture(target, prompts, max_new, batch, layers) -> dict:
    t0 = time.perf_counter()
    responses = []
    for i in range(0, len(prompts), batch):
        responses += generate_batch(
            target,
            prompts[i : i + batch],
            max_new_tokens=max_new,
            sampling=SamplingConfig(greedy=True),
            seed=0,
        )
    t1 = time.perf_counter()
    capture = HiddenStateCapture(target, layers, "float32")
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor(p + r, dtype=torch.int32)
        capture(TokenSample(i, str(i), ids, torch.arange(len(ids)) >= len(p)))
    capture.close()
    t2 = time.perf_counter()
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    return {
        "path": "transformers+capture",
        "batch": batch,
        "tokens": tokens,
        "response_tokens": sum(map(len, responses)),
        "generate_s": round(t1 - t0, 2),
        "capture_s": round(t2 - t1, 2),
        "wall_s": round(t2 - t0, 2),
        "onpolicy_tok_s": round(tokens / (t2 - t0), 1),
    }


def recorded(target, llama, prompts, max_new, batch, layers) -> dict:
    taps = tuple(sorted({*layers, target.num_layers - 1}))
    t0 = time.perf_counter()
    runs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        traces, _, rec = decode_recorded(
            llama, target.eos_token_id, target.max_context, chunk, max_new, taps, reach=0
        )
        runs.append((chunk, [t.tokens for t in traces], rec))
    wall = time.perf_counter() - t0
    # States captured step by step against the extract stage's full forward, on a few rows.
    capture = HiddenStateCapture(target, layers, "float32")
    worst = 0.0
    for chunk, outs, rec in runs[:1]:
        for row, (p, r) in enumerate(list(zip(chunk, outs, strict=True))[:4]):
            ids = torch.tensor(p + r, dtype=torch.int32)
            full = capture(TokenSample(row, str(row), ids, torch.arange(len(ids)) >= len(p)))
            for j, layer in enumerate(layers):
                got = rec.feats[layer][row, : len(ids)]
                worst = max(worst, float((got - full.aux_hidden[j]).abs().max()))
    capture.close()
    tokens = sum(
        len(p) + len(r) for chunk, outs, _ in runs for p, r in zip(chunk, outs, strict=True)
    )
    return {
        "path": f"dspark-recorded@{batch}",
        "batch": batch,
        "tokens": tokens,
        "response_tokens": sum(len(r) for _, outs, _ in runs for r in outs),
        "wall_s": round(wall, 2),
        "onpolicy_tok_s": round(tokens / wall, 1),
        "max_abs_diff_vs_full_forward": worst,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batches", default="16,32", help="rows decoded together, comma-separated")
    ap.add_argument("--shards", type=Path, default=ROOT / "artifacts" / "shards")
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "onpolicy.json")
    args = ap.parse_args(argv)
    params = load_params(ROOT / "params.yaml")
    set_threads(params.provision.threads)
    target = load_target_for(params.target, args.target)
    llama = Llama.from_hf(target.model)
    layers = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    prompts = prompts_of(args.shards, args.prompts)
    batches = [int(b) for b in args.batches.split(",")]
    rows = [transformers_then_capture(target, prompts, args.max_new, batches[0], layers)]
    rows += [recorded(target, llama, prompts, args.max_new, b, layers) for b in batches]
    base = rows[0]["onpolicy_tok_s"]
    print(f"{'path':<24} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'x today':>8} {'max diff':>9}")
    for r in rows:
        r["ratio_to_today"] = round(r["onpolicy_tok_s"] / base, 2)
        diff = r.get("max_abs_diff_vs_full_forward")
        print(
            f"{r['path']:<24} {r['tokens']:>7} {r['wall_s']:>8} {r['onpolicy_tok_s']:>8} "
            f"{r['ratio_to_today']:>8} {'' if diff is None else f'{diff:.1e}':>9}"
        )
    payload = {"prompts": len(prompts), "max_new_tokens": args.max_new, "runs": rows}
    payload["cpu"] = cpu_features()
    write_metrics(args.out, params.profile, payload)


if __name__ == "__main__":
    main()
