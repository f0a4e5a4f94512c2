"""Why `dspark_adaptive` loses to `none` at concurrency 8 in a benchmark sweep and not alone
(issue 20): the same cells, side by side, from a server that ran the sweep's earlier cells
and from one that did not, with what each server did per step.

    python -m benchmarks.adaptive [--profile default] [--concurrency 8] [--rounds 4] \
        [--history 1,2,4] [--requests N] [--out metrics/studies/bench_adaptive.json]

Three endpoints of the profile's target and drafts (its artifacts here, or `--target`, `--drafts`
and `--prompts`), up at once as the benchmark runs them:
  none       the target alone
  seasoned   dspark_adaptive, first driven through the `--history` cells (as a sweep does)
  fresh      dspark_adaptive, first used at `--concurrency`
The history cells also go to `none`, so both it and `seasoned` have served the same requests.
Then `--rounds` rounds of the cell at `--concurrency`, each round in a rotated order. Per cell:
throughput, steps and how many drafted, the verify and drafting time per step, the server's
minor page faults per step (a process's allocator state is history too), and the scheduler's
state after it. Prints a table and writes JSON. Run it alone: the two cores are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path

from dspark.config import load_params
from dspark.io import write_json
from dspark.metrics import cpu_features
from dspark.net import free_port
from dspark.pipeline import DRAFTS, EVAL_PROMPTS, TARGET_DIR
from dspark.serve.endpoints import EndpointProcess
from dspark.serve.measure import run_cell, run_client
from dspark.serve.rounds import rotated
from dspark.serve.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (/proc/PID/stat, field 10)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def cell(ep: EndpointProcess, name: str, concurrency: int, params, requests, tmp) -> dict:
    faults = minor_faults(ep.proc.pid)
    out = run_cell(ep, concurrency, params.benchmark.workload, params, requests, tmp)
    out["server"] = name
    out["minflt_per_step"] = round((minor_faults(ep.proc.pid) - faults) / max(out["steps"], 1), 1)
    out["scheduler"] = ep.stats().get("scheduler")  # its state after the cell
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--history", default="1,2,4")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="per measured cell, at least the concurrency (history cells: the profile's count)",
    )
    ap.add_argument("--target", type=Path, default=ROOT / TARGET_DIR)
    ap.add_argument("--drafts", type=Path, default=ROOT / DRAFTS)
    ap.add_argument("--prompts", type=Path, default=ROOT / EVAL_PROMPTS)
    ap.add_argument("--out", type=Path, default=ROOT / "metrics/studies/bench_adaptive.json")
    args = ap.parse_args(argv)

    params = load_params(ROOT / "params.yaml", args.profile)
    measured = params  # the history cells send the profile's counts, as a sweep does
    if args.requests is not None:
        bench = params.benchmark.model_copy(
            update={"min_requests": args.requests, "requests_per_client": 1}
        )
        measured = params.model_copy(update={"benchmark": bench})
    history = [int(c) for c in args.history.split(",") if c]
    host = params.serve.host
    target, drafts = args.target, args.drafts

    from dspark.models.target import load_target_for

    requests = build_requests(params, load_target_for(params.target, target), args.prompts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        resolved = tmp / "params.json"
        write_json(resolved, params.model_dump(mode="json"))
        servers = {}
        for name, mode in (("none", "none"), ("seasoned", "dspark_adaptive")):
            log = tmp / f"{name}.log"
            servers[name] = stack.enter_context(
                EndpointProcess(mode, host, free_port(host), ROOT, log, resolved, target, drafts)
            )
        for ep in servers.values():
            ep.wait_ready()
        # The fresh one profiles its verify cost alone, as the benchmark starts the adaptive mode.
        log = tmp / "fresh.log"
        servers["fresh"] = stack.enter_context(
            EndpointProcess(
                "dspark_adaptive", host, free_port(host), ROOT, log, resolved, target, drafts
            )
        )
        servers["fresh"].wait_ready()
        workload = requests[params.benchmark.workload]
        for ep in servers.values():  # the benchmark's warm-up request
            run_client(ep.url, workload, 1, 1, params.benchmark, tmp, ep.client_args)
        for c in history:
            for name in ("none", "seasoned"):
                row = cell(servers[name], name, c, params, requests, tmp)
                row["phase"] = "history"
                rows.append(row)
                print(f"history {name:9s} c={c:<3d} {row['tok_s']} tok/s", flush=True)
        for i in range(args.rounds):
            for name in rotated(list(servers), i):
                row = cell(servers[name], name, args.concurrency, measured, requests, tmp)
                row["phase"], row["round"] = "measured", i + 1
                rows.append(row)
                print(
                    f"round {i + 1} {name:9s} c={args.concurrency:<3d} {row['tok_s']} tok/s, "
                    f"verify {row['verify_ms']} ms/step, drafted {row['draft_steps']}/"
                    f"{row['steps']}, {row['minflt_per_step']} faults/step",
                    flush=True,
                )
    result = {"profile": params.profile, "concurrency": args.concurrency, "history": history}
    result["cpu"] = cpu_features()
    result["summary"] = summarize(rows, args.concurrency)
    result["cells"] = rows
    print(table(result["summary"]))
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


def summarize(rows: list[dict], concurrency: int) -> dict:
    """Per server: median throughput, verify ms/step and faults/step over the measured rounds,
    and each adaptive server's median same-round ratio to `none`."""
    measured = [r for r in rows if r["phase"] == "measured"]
    by_round: dict[int, dict[str, dict]] = {}
    for r in measured:
        by_round.setdefault(r["round"], {})[r["server"]] = r
    out = {}
    for name in ("none", "seasoned", "fresh"):
        mine = [r for r in measured if r["server"] == name]
        ratios = [g[name]["tok_s"] / g["none"]["tok_s"] for g in by_round.values()]
        out[name] = {
            "concurrency": concurrency,
            "tok_s": round(statistics.median(r["tok_s"] for r in mine), 2),
            "verify_ms": round(statistics.median(r["verify_ms"] for r in mine), 2),
            "draft_ms": round(statistics.median(r["draft_ms"] for r in mine), 2),
            "drafted_share": round(
                sum(r["draft_steps"] for r in mine) / max(sum(r["steps"] for r in mine), 1), 4
            ),
            "minflt_per_step": statistics.median(r["minflt_per_step"] for r in mine),
            "x_none": round(statistics.median(ratios), 3),
            "x_none_rounds": [round(x, 3) for x in ratios],
        }
    return out


def table(summary: dict) -> str:
    cols = ("tok_s", "x_none", "verify_ms", "draft_ms", "drafted_share", "minflt_per_step")
    lines = [f"{'server':10s}" + "".join(f" {c:>15s}" for c in cols)]
    for name, s in summary.items():
        lines.append(f"{name:10s}" + "".join(f" {s[c]!s:>15s}" for c in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
