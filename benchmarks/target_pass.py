"""The target's pass against its floor: for k tokens in one row, what our forward (the
decoder's Llama) costs, what its matrix multiplies alone cost, and what reading its bytes must
cost.

    python -m benchmarks.target_pass [--tokens 1 2 3 4 6 8 12 16 24 32] [--context 300] \
        [--repeats 15]

A decode pass of a few tokens reads every weight once (about 540 MB for SmolLM2 in fp32) and
does little arithmetic on each, so its floor is the bytes it must read (weights, and the keys
and values of the context) over the machine's read bandwidth, measured here in the same run.
From some k on the arithmetic takes over: the compute floor is the pass's multiply-adds over a
large cache-resident multiply's rate, also measured here. Between the floor and the forward sit
the multiplies themselves (the same shapes through `F.linear`, nothing else) and everything
else the forward does (attention, norms, rope, cache writes, Python); the profile of the 1- and
2-token passes (torch.profiler, per operator, ms per pass) says which.

Each trained draft under `--drafts` is timed the same way: one proposal for one row at the same
context, against its floor, its own weights read once per forward it runs (one for a block
draft, one per drafted token for EAGLE-3; the target's embedding rows it looks up are few and
left out).

Measurements alternate between the forward and the bare multiplies per repeat, so a busy
machine shifts both alike; run it alone all the same. Prints a table and writes
metrics/studies/target_pass.json, with the CPU's flags and the thread count beside the figures.
Needs the provision stage's artifacts/target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dspark.config import load_params
from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DSparkProposer
from dspark.decode.llama import Llama
from dspark.decode.sampling import GREEDY
from dspark.drafts import DRAFT_KINDS, load_proposer
from dspark.metrics import cpu_features, write_metrics
from dspark.models.target import load_target_for, set_threads

ROOT = Path(__file__).resolve().parents[1]


def weights(model: Llama) -> list[torch.Tensor]:
    """Every matrix a pass multiplies by, as our forward lays them out."""
    out = []
    for layer in model.layers:
        out += [layer.qkv.weight, layer.o_proj.weight, layer.gate_up.weight, layer.down.weight]
    return [*out, model.lm_head.weight]


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a sum over a buffer far larger than the caches reads (median)."""
    buf = torch.ones(int(gib * 2**30) // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times)


def gemm_rate(repeats: int = 20) -> float:
    """Multiply-adds per second of a large multiply whose operands stay in cache."""
    x, w = torch.randn(512, 576), torch.randn(1536, 576)
    F.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return repeats * x.shape[0] * w.numel() / (time.perf_counter() - t0)


class Pass:
    """One row at `context` tokens, verifying k more: our forward and the same
    multiplies alone, timed in turn."""

    def __init__(self, model: Llama, context: int, k: int, gen: torch.Generator):
        self.model, self.context, self.k = model, context, k
        vocab = model.embed_tokens.num_embeddings
        self.cache = model.new_cache(1, context + k + 1)
        prompt = torch.randint(0, vocab, (1, context), generator=gen)
        model(prompt, torch.arange(context)[None], self.cache, logits_at=torch.zeros(1, 1).long())
        self.tokens = torch.randint(0, vocab, (1, k), generator=gen)
        self.positions = (context + torch.arange(k))[None]
        self.inputs = {
            w.shape[1]: torch.randn(1, k, w.shape[1], generator=gen) for w in weights(model)
        }
        self.weights = weights(model)

    def forward(self) -> float:
        t0 = time.perf_counter()
        self.model(self.tokens, self.positions, self.cache)
        return time.perf_counter() - t0

    def multiplies(self) -> float:
        t0 = time.perf_counter()
        for w in self.weights:
            F.linear(self.inputs[w.shape[1]], w)
        return time.perf_counter() - t0

    def bytes_read(self) -> int:
        s = self.model.s
        kv = 2 * len(self.model.layers) * s.num_kv_heads * s.head_dim * (self.context + self.k)
        return sum(w.numel() for w in self.weights) * 4 + kv * 4

    def multiply_adds(self) -> int:
        return self.k * sum(w.numel() for w in self.weights)


def draft_costs(
    model: Llama, target, drafts: Path, context: int, repeats: int, bandwidth: float
) -> list[dict]:
    """ms per proposal of every trained draft in `drafts`, one row at `context` tokens, against
    its bandwidth floor."""
    out = []
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()
    for kind in DRAFT_KINDS.names():
        folder = drafts / kind
        if not folder.is_dir():
            continue
        prop = load_proposer(folder, target.embed)
        pre = SpecDecoder(model, prop, target.eos_token_id, target.max_context).prefill(
            [prompt], max_new_tokens=2
        )
        prop.start(1, pre.seq.shape[1] - 1)
        pre.seq[0, context] = int(pre.logits[0].argmax())
        prop.extend(pre.seq, torch.zeros(1, dtype=torch.long), pre.lens, pre.feats)
        active = torch.ones(1, dtype=torch.bool)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            prop.propose(pre.seq, pre.lens.clone(), active, GREEDY, None)
            times.append(time.perf_counter() - t0)
        forwards = 1 if isinstance(prop, DSparkProposer) else prop.k  # a block, or k steps
        weights = sum(p.numel() * p.element_size() for p in prop.model.parameters())
        ms = statistics.median(times[1:]) * 1000
        floor = forwards * weights / bandwidth * 1000
        out.append(
            {
                "draft": kind,
                "drafts_per_proposal": prop.k,
                "ms": round(ms, 2),
                "floor_ms": round(floor, 3),
                "over_floor": round(ms / floor, 2),
            }
        )
    return out


def operator_profile(p: Pass, passes: int = 10, top: int = 12) -> list[dict]:
    """ms per pass by operator (self time), the largest first."""
    p.forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            p.forward()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) / 1000 / passes
    out = [
        {
            "op": e.key,
            "ms": round(e.self_cpu_time_total / 1000 / passes, 3),
            "calls": e.count // passes,
        }
        for e in rows[:top]
    ]
    rest = total - sum(r["ms"] for r in out)
    calls = sum(e.count for e in rows[top:]) // passes
    return [*out, {"op": "(the rest)", "ms": round(rest, 3), "calls": calls}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="default: every core")
    ap.add_argument(
        "--bandwidth-gib", type=float, default=1.0, help="buffer the read bandwidth is timed on"
    )
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "target")
    ap.add_argument(
        "--drafts", type=Path, default=ROOT / "artifacts" / "drafts", help="trained drafts to time"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "target_pass.json")
    args = ap.parse_args(argv)
    if min(args.tokens) < 1 or args.context < 1 or args.repeats < 3:
        ap.error("--tokens and --context at least 1, --repeats at least 3")
    params = load_params(ROOT / "params.yaml")
    threads = set_threads(args.threads)
    target = load_target_for(params.target, args.target)
    model = Llama.from_hf(target.model)
    gen = torch.Generator().manual_seed(0)
    bandwidth, rate = read_bandwidth(args.bandwidth_gib), gemm_rate()
    rows, profiles = [], {}
    for k in args.tokens:
        p = Pass(model, args.context, k, gen)
        p.forward(), p.multiplies()  # warm
        forward, mults = [], []
        for _ in range(args.repeats):
            forward.append(p.forward())
            mults.append(p.multiplies())
        floor = max(p.bytes_read() / bandwidth, p.multiply_adds() / rate)
        e, m = statistics.median(forward) * 1000, statistics.median(mults) * 1000
        rows.append(
            {
                "tokens": k,
                "forward_ms": round(e, 2),
                "multiplies_ms": round(m, 2),
                "floor_ms": round(floor * 1000, 2),
                "forward_over_multiplies": round(e / m, 3),
                "forward_over_floor": round(e / (floor * 1000), 3),
            }
        )
        if k in (1, 2):
            profiles[str(k)] = operator_profile(p)
    drafts = draft_costs(model, target, args.drafts, args.context, args.repeats, bandwidth)
    one = next((r for r in rows if r["tokens"] == 1), None)
    if one:
        for r in rows:
            r["forward_over_one"] = round(r["forward_ms"] / one["forward_ms"], 3)
    print(f"context {args.context}, {threads} threads; read {bandwidth / 1e9:.1f} GB/s, "
          f"multiply {rate / 1e9:.1f} G multiply-adds/s")  # fmt: skip
    head = ("k", "forward ms", "multiplies", "floor", "fwd/mult", "fwd/floor")
    print("".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = [r["tokens"], r["forward_ms"], r["multiplies_ms"], r["floor_ms"]]
        cells += [r["forward_over_multiplies"], r["forward_over_floor"]]
        print("".join(f"{c:>11}" for c in cells))
    if drafts:
        print("\ndraft, ms per proposal against its floor:")
        for d in drafts:
            print(f"  {d['draft']:>7} k={d['drafts_per_proposal']}: {d['ms']:.2f} ms, "
                  f"floor {d['floor_ms']:.3f} ms ({d['over_floor']}x)")  # fmt: skip
    for k, ops in profiles.items():
        print(f"\nk={k}, ms per pass by operator:")
        for op in ops:
            print(f"  {op['ms']:>8.3f}  {op['calls']:>5}  {op['op']}")
    write_metrics(
        args.out,
        params.profile,
        {
            "command": "python -m benchmarks.target_pass "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "cpu": cpu_features(),
            "threads": threads,
            "context": args.context,
            "repeats": args.repeats,
            "read_bytes_per_s": round(bandwidth),
            "multiply_adds_per_s": round(rate),
            "passes": rows,
            "drafts": drafts,
            "profile_ms": profiles,
        },
    )


if __name__ == "__main__":
    main()
