"""The benchmark's measure loop: every mode's endpoint up at once, then each cell driven by the
load client (a subprocess) for every mode in turn, with the server's step counters read around
it; and transformers' generate timed alone, the other `none`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dspark.config import Params
from dspark.io import write_json
from dspark.net import free_port
from dspark.progress import bar
from dspark.records import Records
from dspark.serve.client import summarize
from dspark.serve.endpoints import EndpointProcess
from dspark.serve.rounds import merge_rounds, rotated
from dspark.serve.vllm_mode import MODE as VLLM_MODE
from dspark.serve.vllm_mode import VllmEndpoint
from dspark.serve.workload import cell_plan


def run_client(
    url: str, requests: list[dict], concurrency: int, count: int, cfg, tmp: Path, extra=()
):
    """One cell through the load client process -> its raw records."""
    reqs, out = tmp / "requests.json", tmp / "cell.json"
    write_json(reqs, [{"id": r["id"], "prompt": r["prompt"]} for r in requests])
    argv = [sys.executable, "-m", "dspark.serve.client", "--url", url, "--requests", str(reqs)]
    argv += ["--concurrency", str(concurrency), "--max-requests", str(count)]
    argv += ["--max-seconds", str(cfg.max_seconds), "--max-tokens", str(cfg.max_tokens)]
    argv += ["--out", str(out), *extra]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"load client failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return json.loads(out.read_text())


def measure(
    params: Params,
    requests,
    *,
    target: Path,
    drafts: Path,
    logs: Path,
    root: Path,
    log,
    progress: bool = True,
    single: Callable[[], dict] | None = None,
    verify_costs: list[dict] | None = None,
    records: Records | None = None,
) -> list[dict]:
    """Every mode's endpoint up at once (its log in `logs`), then each cell run mode after mode:
    the modes of a cell are measured minutes apart at most, so the machine's drift shows in
    every one alike (on this shared 2-core machine one mode's step time moves 15% between
    loads). `single` measures one more cell beside the single-stream ones (transformers'
    generate). The verify-cost tables the endpoints profiled at start ({mode: table}) go into
    `verify_costs`, one entry per start that measured cells.

    With `benchmark.rounds` above 1, each cell's modes are measured that many times, each
    round in a rotated order, and merged (`rounds.merge_rounds`).

    With `records`, each cell is recorded once all its modes are measured (with the tables it
    ran under), and a rerun replays the recorded ones: a stopped benchmark goes on at the first
    cell it had not finished, and every cell's modes were still measured side by side."""
    verify_costs = [] if verify_costs is None else verify_costs
    cfg, host = params.benchmark, params.serve.host
    plan = cell_plan(params)

    def key(concurrency: int, workload: str) -> str:
        return f"c={concurrency} {workload}"

    done = {key(*p): r for p in plan if records and (r := records.get(key(*p)))}
    for r in done.values():
        if r["verify_cost"] not in verify_costs:
            verify_costs.append(r["verify_cost"])
    if len(done) == len(plan):
        log(f"all {len(plan)} cells recorded by an earlier run: nothing to measure")
        return [x for p in plan for x in done[key(*p)]["cells"]]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        resolved = tmp / "params.json"
        write_json(resolved, params.model_dump(mode="json"))
        started = {}
        # The adaptive mode times the verify pass at start: it starts alone, after the rest.
        quiet = [m for m in cfg.modes if m == "dspark_adaptive"]
        for group in ([m for m in cfg.modes if m not in quiet], quiet):
            for mode in group:
                log_file = logs / f"{mode}.log"
                if mode == VLLM_MODE:
                    ep = VllmEndpoint(params, target, root, host, log_file)
                else:
                    ep = EndpointProcess(
                        mode, host, free_port(host), root, log_file, resolved, target, drafts
                    )
                started[mode] = stack.enter_context(ep)
            if group:
                log(f"benchmark: starting {', '.join(group)} (loading, profiling)")
            for mode in group:
                started[mode].wait_ready()
                log(f"benchmark: {mode} ready")
        endpoints = [started[m] for m in cfg.modes]
        tables = {ep.mode: t for ep in endpoints if (t := ep.stats().get("verify_cost"))}
        verify_costs.append(tables)
        if cfg.warmup_requests:
            log(f"benchmark: warm-up, {cfg.warmup_requests} request(s) per mode")
        for ep in endpoints:
            if cfg.warmup_requests:
                run_client(
                    ep.url, requests[cfg.workload], 1, cfg.warmup_requests, cfg, tmp, ep.client_args
                )
        cells = []
        todo = [p for p in plan if key(*p) not in done]
        total = len(todo) * cfg.rounds * len(endpoints)
        total += cfg.rounds if single and (1, cfg.workload) in todo else 0
        runs = bar(total=total, desc="benchmark", unit="runs", enabled=progress)
        for concurrency, workload in plan:
            if key(concurrency, workload) in done:
                cells += done[key(concurrency, workload)]["cells"]
                log(f"c={concurrency:<3d} {workload:15s} recorded by an earlier run")
                continue
            rounds = []
            for i in range(cfg.rounds):
                tag = f"round {i + 1}/{cfg.rounds}: " if cfg.rounds > 1 else ""
                group = []
                if single and (concurrency, workload) == (1, cfg.workload):
                    group.append(single())
                    runs.update(1)
                    log(f"{tag}{'none_hf':16s} c=1   {workload:15s} {group[-1]['tok_s']} tok/s")
                for ep in rotated(endpoints, i):
                    group.append(run_cell(ep, concurrency, workload, params, requests, tmp))
                    runs.update(1)
                    x = group[-1]
                    log(
                        f"{tag}{ep.mode:16s} c={concurrency:<3d} {workload:15s} "
                        f"{x['tok_s']} tok/s, TTFT p50 {x['ttft_p50_ms']} ms, tau {x['tau']}"
                    )
                rounds.append(group)
            group = merge_rounds(rounds)
            if records:
                records.put(key(concurrency, workload), cells=group, verify_cost=tables)
            cells += group
        runs.close()
        return cells


def run_cell(ep: EndpointProcess, concurrency: int, workload: str, params, requests, tmp):
    cfg = params.benchmark
    count = max(cfg.min_requests, cfg.requests_per_client * concurrency)
    before = ep.stats()
    raw = run_client(ep.url, requests[workload], concurrency, count, cfg, tmp, ep.client_args)
    after = ep.stats()
    cell = {"mode": ep.mode, "concurrency": concurrency, "workload": workload}
    cell.update(summarize(raw))
    cell.update(step_costs(before, after))
    if cell["errors"]:
        first = next(r["error"] for r in raw["records"] if "error" in r)
        raise RuntimeError(f"{ep.mode} c={concurrency}: {cell['errors']} requests failed: {first}")
    return cell


def step_costs(before: dict, after: dict) -> dict:
    steps = after["steps"] - before["steps"]
    draft, verify = after["draft_s"] - before["draft_s"], after["verify_s"] - before["verify_s"]
    # Steps that drafted (`dspark_adaptive` skips drafting where it does not pay).
    drafted = after.get("draft_steps", 0) - before.get("draft_steps", 0)
    if steps <= 0:
        return {"steps": 0, "draft_steps": 0, "draft_ms": None, "verify_ms": None,
                "draft_share": None}  # fmt: skip
    return {
        "steps": steps,
        "draft_steps": drafted,
        "draft_ms": round(draft * 1000 / steps, 2),
        "verify_ms": round(verify * 1000 / steps, 2),
        "draft_share": round(draft / (draft + verify), 4) if draft + verify > 0 else None,
    }


def hf_baseline(params: Params, target, requests: list[dict]) -> dict:
    """transformers' static-cache greedy generate, one request at a time: the other `none`."""
    from dspark.decode.reference import Reference
    from dspark.evaluate.summary import distinct_n

    cfg = params.benchmark
    ref = Reference(target)
    ref.generate(requests[0]["prompt"], 2)  # warm-up: the static cache's first compile
    count = max(cfg.min_requests, cfg.requests_per_client)
    tokens, wall, ttft, distinct = 0, 0.0, [], []
    for i in range(count):
        ids = requests[i % len(requests)]["prompt"]
        _, first_s = ref.generate(ids, 1)
        out, seconds = ref.generate(ids, cfg.max_tokens)
        tokens, wall = tokens + len(out), wall + seconds
        ttft.append(first_s * 1000)
        distinct.append(distinct_n(out))
    return {
        "mode": "none_hf",
        "concurrency": 1,
        "workload": cfg.workload,
        "requests": count,
        "tokens": tokens,
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": round(sorted(ttft)[len(ttft) // 2], 1),
        "tau": 1.0,
        "distinct_2": round(sum(distinct) / len(distinct), 4),
    }
