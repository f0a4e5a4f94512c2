"""Trainer throughput on one device at the target's real shapes: tokens/s per draft.

    python infra/gpu/train_bench.py [--device cuda] [--batch-sizes 8,32] [--steps 12]

The full profile's drafts (`train.*` of `--profile`, 8,192-token draft vocabulary, its anchors
and heads) are built by `build_runs` over a random target of SmolLM2-135M-Instruct's shape
(576 wide, 49,152-token vocabulary: the lm_head rebuild in collate costs what it costs there) and
trained by `Trainer` on synthetic samples as long as the full profile's (295 tokens on average,
the first 30% prompt). Random weights and data train at the speed real ones do; no model or
hidden states need to travel to the machine, so this runs where the target cannot be installed.

A draft's tokens/s is counted as the trainer counts it (metrics/train.json): the batch's tokens
over its optimizer step plus the whole collate. The first `--warmup` steps (allocator, kernels,
the context-scale calibration) are not counted. Prints a table and writes OUT/train_bench.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from train_check import synthetic_samples, synthetic_target  # noqa: E402

from dspark.config import load_params  # noqa: E402
from dspark.metrics import write_metrics  # noqa: E402
from dspark.models.vocab import build_draft_ids, count_tokens  # noqa: E402
from dspark.train.batch import TargetHead  # noqa: E402
from dspark.train.sources import Source  # noqa: E402
from dspark.train.stage import build_runs  # noqa: E402
from dspark.train.trainer import Trainer  # noqa: E402

SMOLLM2_135M = {  # its config.json, the fields the drafts read
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}
AUX_LAYERS = [1, 15, 27]  # three, as the full profile extracts; which ones does not matter here
MEAN_LEN, PROMPT_SHARE = 295, 0.3  # the full profile's 1,474,869 tokens over 5,000 samples


def full_profile_shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (length, prompt length) pairs of 150-440 tokens (mean 295), the first 30% prompt."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MEAN_LEN - 145, MEAN_LEN + 146, (n,), generator=gen).tolist()
    return [(s, int(s * PROMPT_SHARE)) for s in lengths]


def bench(device: str, profile: str, batch: int, steps: int, warmup: int) -> dict:
    """Train every draft of `profile` for warmup + steps at `batch`; -> tokens/s per draft."""
    total = warmup + steps
    p = load_params(
        HERE.parents[1] / "params.yaml",
        profile=profile,
        overrides=[
            f"train.device={device}",
            f"train.batch_size={batch}",
            f"train.max_steps={total}",
            "train.epochs=1",
            "train.eval_samples=1",
            "train.eval_points=1",
            f"train.checkpoint_every={total}",
        ],
    )
    shape = SMOLLM2_135M
    target = synthetic_target(shape)
    samples = synthetic_samples(
        full_profile_shapes(1 + batch * total),
        len(AUX_LAYERS),
        shape["hidden_size"],
        shape["vocab_size"],
    )
    draft_ids = build_draft_ids(
        count_tokens(samples[1:], shape["vocab_size"]), p.train.draft_vocab_size
    )
    where = torch.device(device)
    runs = build_runs(p, target, draft_ids, AUX_LAYERS, 3, where)
    timed: dict[str, list[tuple[float, int]]] = {r.name: [] for r in runs}

    def timing(run):  # (seconds, tokens) of each step, as DraftRun.step counts them
        step = run.step

        def counted(batch_, *args, **kwargs):
            out = step(batch_, *args, **kwargs)
            tokens = int(batch_.tokens)
            timed[run.name].append((tokens / out["tokens_per_s"], tokens))
            return out

        run.step = counted

    for run in runs:
        timing(run)
    with tempfile.TemporaryDirectory(prefix="dspark-train-bench-") as tmp:
        trainer = Trainer(
            cfg=p.train,
            runs=runs,
            head=TargetHead(target.norm, target.lm_head, draft_ids).to(where),
            checkpoint_dir=Path(tmp),
            fingerprint="train-bench",
            progress=False,
        )
        trainer.fit(
            lambda ids: nullcontext(Source(iter([samples[i] for i in sorted(ids)]))),
            list(range(1, len(samples))),
            [0],
        )
    rows = {}
    for name, per_step in timed.items():
        kept = per_step[warmup:]
        seconds, tokens = sum(s for s, _ in kept), sum(t for _, t in kept)
        rows[name] = {
            "steps": len(kept),
            "tokens": tokens,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--batch-sizes", default="8,32", help="comma-separated")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per batch size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.gettempdir())))
    args = ap.parse_args(argv)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batch-sizes: {args.batch_sizes!r} is not a comma-separated list of sizes")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("train-bench: torch sees no CUDA device", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # float32, as the trainer runs
    report = {
        "device": args.device,
        "device_name": (torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "profile": args.profile,
        "target_shape": SMOLLM2_135M,
        "by_batch": {},
    }
    print(f"{'batch':>6} {'draft':<8} {'steps':>5} {'tokens':>8} {'tok/s':>10}")
    for b in sizes:
        rows = bench(args.device, args.profile, b, args.steps, args.warmup)
        report["by_batch"][str(b)] = rows
        for name, r in rows.items():
            print(f"{b:>6} {name:<8} {r['steps']:>5} {r['tokens']:>8} {r['tokens_per_s']:>10}")
    write_metrics(args.out / "train_bench.json", args.profile, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
