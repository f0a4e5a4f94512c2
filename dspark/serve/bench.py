"""The benchmark stage: every mode served in turn by `dspark endpoint` (a subprocess on
loopback), driven cell by cell by the load client (another subprocess), then the figures side by
side: throughput and TTFT against concurrency, the cost split of a step, the speedup predicted
at concurrency 1 from tau and step costs, and where fixed-k speculation stops paying.

A cell is (mode, concurrency, workload): `requests_per_client` x c requests (at least
`min_requests`), closed loop, after the mode's warm-up requests. All modes' endpoints run at once
(idle ones cost nothing) and each cell is run for every mode in turn, so ratios compare
measurements taken side by side. Around each cell the server's step counters are read, so each
cell knows its steps and how its time split between drafting and verification. Mode `none_vllm`
(opt-in) serves vLLM's own server instead of ours: see `vllm_mode.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from dspark.config import Params
from dspark.data.prompts import read_prompt_file
from dspark.errors import DataError
from dspark.io import write_json
from dspark.procs import stop_processes
from dspark.records import Records, fingerprint
from dspark.serve import report
from dspark.serve.client import summarize
from dspark.serve.rounds import merge_rounds, paired_ratio, per_round, rotated, round_max, spread
from dspark.serve.vllm_mode import MODE as VLLM_MODE
from dspark.serve.vllm_mode import VllmEndpoint
from dspark.stopping import exit_on_sigterm

SPECULATIVE = ("ngram", "eagle3", "dspark_fixed", "dspark_adaptive")
READY_TIMEOUT_S = 900.0  # loading plus the adaptive mode's verify-cost profile


@dataclass(frozen=True)
class BenchPaths:
    target: Path
    drafts: Path
    prompts: Path
    plots: Path
    report: Path
    logs: Path
    records: Path  # the cells measured so far: the stage's checkpoint


def build_requests(params: Params, target, prompts_file: Path) -> dict[str, list[dict]]:
    """Workload name -> requests {id, category, prompt: token ids} with prompt lengths in the
    band. `mix` interleaves the categories, so any prefix of it is mixed."""
    cfg = params.benchmark
    lo, hi = cfg.prompt_tokens
    by_cat: dict[str, list[dict]] = {}
    for p in read_prompt_file(prompts_file):
        ids = target.chat_ids(list(p.messages))
        if lo <= len(ids) <= hi:
            by_cat.setdefault(p.category, []).append(
                {"id": p.id, "category": p.category, "prompt": ids}
            )
    names = {cfg.workload} | ({"mix"} if cfg.mixed_concurrency else set())
    out = {}
    for name in sorted(names):
        if name == "mix":
            queues = [list(v) for _, v in sorted(by_cat.items())]
            mixed = []
            while any(queues):
                mixed.extend(q.pop(0) for q in queues if q)
            out[name] = mixed
        else:
            out[name] = by_cat.get(name, [])
        if not out[name]:
            raise DataError(
                f"{prompts_file}: no {name} prompt of {lo}..{hi} tokens "
                "(benchmark.prompt_tokens, benchmark.workload)"
            )
    return out


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EndpointProcess:
    """`dspark endpoint` for one mode, in this process group (a group kill reaches it), with
    its log in `log`. A context manager: the server is stopped, and its port freed, on exit."""

    client_args: tuple[str, ...] = ()  # what the load client adds for this server

    def __init__(self, mode: str, host: str, port: int, root: Path, log: Path, resolved: Path):
        self.mode, self.url = mode, f"http://{host}:{port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "dspark", "endpoint", "--mode", mode]
        argv += ["--host", host, "--port", str(port), "--resolved", str(resolved)]
        self.proc = subprocess.Popen(
            argv, cwd=root, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = " | ".join(self.log.read_text().strip().splitlines()[-3:])
                raise RuntimeError(f"endpoint {self.mode} exited ({self.proc.returncode}): {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"endpoint {self.mode}: not ready after {timeout:.0f} s ({self.log})")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/dspark/stats", timeout=10.0).json()

    def stop(self) -> None:
        stop_processes([self.proc], grace=30)
        self._log.close()

    def __enter__(self) -> EndpointProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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


def cell_plan(params: Params) -> list[tuple[int, str]]:
    cfg = params.benchmark
    cells = [(c, cfg.workload) for c in cfg.concurrency]
    if cfg.mixed_concurrency:
        cells.append((cfg.mixed_concurrency, "mix"))
    return cells


def bench_records(params: Params, paths: BenchPaths) -> Records:
    """The cells measured so far by a run with the same params, inputs and serving code."""
    from dspark.models.target import read_manifest
    from dspark.stages import BY_NAME

    basis = {  # the stage's DVC params, and the target's weights
        "params": params.model_dump(
            mode="json", include={"target", "provision", "serve", "benchmark"}
        ),
        "block_size": params.train.dspark.block_size,
        "target": read_manifest(paths.target),
    }
    drafted = sorted(paths.drafts.glob("*/*")) if paths.drafts.is_dir() else []
    code = BY_NAME["benchmark"].deps
    return Records(paths.records, fingerprint(basis, [*drafted, paths.prompts], code))


def measure(
    params: Params,
    requests,
    paths: BenchPaths,
    root: Path,
    log,
    single=None,
    verify_costs: list[dict] | None = None,
    records: Records | None = None,
) -> list[dict]:
    """Every mode's endpoint up at once, then each cell run mode after mode: the modes of a
    cell are measured minutes apart at most, so the machine's drift shows in every one alike
    (on this shared 2-core machine one mode's step time moves 15% between loads). `single`
    measures one more cell beside the single-stream ones (transformers' generate). The
    verify-cost tables the endpoints profiled at start ({mode: table}) go into `verify_costs`,
    one entry per start that measured cells.

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
                log_file = paths.logs / f"{mode}.log"
                if mode == VLLM_MODE:
                    ep = VllmEndpoint(params, paths.target, root, host, log_file)
                else:
                    ep = EndpointProcess(mode, host, free_port(host), root, log_file, resolved)
                started[mode] = stack.enter_context(ep)
            for mode in group:
                started[mode].wait_ready()
        endpoints = [started[m] for m in cfg.modes]
        tables = {ep.mode: t for ep in endpoints if (t := ep.stats().get("verify_cost"))}
        verify_costs.append(tables)
        for ep in endpoints:
            if cfg.warmup_requests:
                run_client(
                    ep.url, requests[cfg.workload], 1, cfg.warmup_requests, cfg, tmp, ep.client_args
                )
        cells = []
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
                    log(f"{tag}{'none_hf':16s} c=1   {workload:15s} {group[-1]['tok_s']} tok/s")
                for ep in rotated(endpoints, i):
                    group.append(run_cell(ep, concurrency, workload, params, requests, tmp))
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
    if steps <= 0:
        return {"steps": 0, "draft_ms": None, "verify_ms": None, "draft_share": None}
    return {
        "steps": steps,
        "draft_ms": round(draft * 1000 / steps, 2),
        "verify_ms": round(verify * 1000 / steps, 2),
        "draft_share": round(draft / (draft + verify), 4) if draft + verify > 0 else None,
    }


def hf_baseline(params: Params, target, requests: list[dict]) -> dict:
    """transformers' static-cache greedy generate, one request at a time: the other `none`."""
    from dspark.evaluate.stage import Reference
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


def benchmark(params: Params, paths: BenchPaths, root: Path, log=print) -> dict:
    from dspark.models.target import load_target

    # A SIGTERM (a cancelled flow, a killed `dvc repro`) unwinds through the `with` blocks,
    # which stop the endpoint and free its port.
    with exit_on_sigterm():
        target = load_target(paths.target, params.target.dtype, params.target.max_context)
        requests = build_requests(params, target, paths.prompts)
        single = None
        if params.benchmark.hf_baseline:

            def single():
                return hf_baseline(params, target, requests[params.benchmark.workload])

        verify_costs: list[dict] = []
        records = bench_records(params, paths)
        # An earlier, stopped run's cells (a cell is one mode's; each of these was measured
        # side by side with the other modes of its concurrency and workload).
        resumed = sum(len(r["cells"]) for r in records.done.values())
        cells = measure(params, requests, paths, root, log, single, verify_costs, records)
    result = assemble(params, cells)
    # {mode: {"tokens": [...], "ms": [...]}} as profiled at the start that measured last;
    # a resumed run's earlier starts profiled their own.
    result["verify_cost"] = verify_costs[-1] if verify_costs else {}
    if len(verify_costs) > 1:
        result["verify_cost_earlier"] = verify_costs[:-1]
    result["resumed_cells"] = resumed
    report.write_plots(result, paths.plots)
    report.write_report(result, paths.report)
    log(report.table(result))
    records.clear()  # finished: a rerun (`dvc repro -f`) measures afresh
    return result


def _cell(cells, mode, c, workload):
    return next(
        (
            x
            for x in cells
            if x["mode"] == mode and x["concurrency"] == c and x["workload"] == workload
        ),
        None,
    )


def assemble(params: Params, cells: list[dict]) -> dict:
    cfg = params.benchmark
    w = cfg.workload
    conc = sorted(set(cfg.concurrency))

    def tok_s(mode, c, workload=w):
        x = _cell(cells, mode, c, workload)
        return x["tok_s"] if x else None

    def rounds(mode, c, workload=w):
        return per_round(_cell(cells, mode, c, workload))

    def baseline(c, workload=w):
        """The fastest target-only path at this concurrency, round by round."""
        return round_max(*(rounds(m, c, workload) for m in ("none", "none_hf")))

    for x in cells:
        x["speedup"] = paired_ratio(per_round(x), baseline(x["concurrency"], x["workload"]))

    # Predicted single-stream speedup: tau x (none's step time / the mode's step time).
    predicted = {}
    none1 = _cell(cells, "none", 1, w)
    for m in SPECULATIVE:
        x = _cell(cells, m, 1, w)
        if x and none1 and x.get("tau") and x.get("steps") and none1.get("steps"):
            t_none = none1["draft_ms"] + none1["verify_ms"]
            t_mode = x["draft_ms"] + x["verify_ms"]
            predicted[m] = round(x["tau"] * t_none / t_mode, 3)
    dspark_modes = [m for m in ("dspark_adaptive", "dspark_fixed") if _cell(cells, m, 1, w)]
    best = max(dspark_modes, key=lambda m: tok_s(m, 1) or 0, default=None)

    crossover = None
    if "dspark_fixed" in cfg.modes and "none" in cfg.modes:
        for c in conc:
            fixed = _cell(cells, "dspark_fixed", c, w)
            if fixed and fixed["speedup"] is not None and fixed["speedup"] < 1:
                crossover = c
                break

    overall = {}  # per mode, for its MLflow child run
    for m in cfg.modes:
        mine = {}
        for x in (x for x in cells if x["mode"] == m and x["workload"] == w):
            c = x["concurrency"]
            mine.update({f"tok_s_c{c}": x["tok_s"], f"ttft_p50_ms_c{c}": x["ttft_p50_ms"]})
            mine.update({f"speedup_c{c}": x["speedup"], f"tau_c{c}": x["tau"]})
        overall[m] = {k: v for k, v in mine.items() if v is not None}
    return {
        "workload": w,
        "max_tokens": cfg.max_tokens,
        "overall": overall,
        "cells": cells,
        "predicted_speedup_c1": predicted.get(best) if best else None,
        "predicted_speedup_c1_by_mode": predicted,
        "crossover_concurrency": crossover,
        "goals": goals(cfg, cells, conc, rounds, baseline, best, predicted),
    }


def goals(cfg, cells, conc, rounds, baseline, best, predicted) -> dict:
    w = cfg.workload
    out: dict = {}
    if best:
        speedup = _cell(cells, best, 1, w)["speedup"]
        out["single_stream"] = {
            "mode": best,
            "speedup": speedup,
            "goal": 3.0,
            "met": bool(speedup and speedup >= 3.0),
        }
        if best in predicted and speedup:
            ratio = round(speedup / predicted[best], 3)
            out["measured_vs_predicted"] = {"ratio": ratio, "goal": 0.85, "met": ratio >= 0.85}
    if "dspark_adaptive" in cfg.modes:
        rows = []
        for c in conc:
            best_other = round_max(rounds("dspark_fixed", c), baseline(c))
            ratio = paired_ratio(rounds("dspark_adaptive", c), best_other)
            if ratio is not None:
                rows.append(
                    {
                        "concurrency": c,
                        "adaptive": _cell(cells, "dspark_adaptive", c, w)["tok_s"],
                        "best_other": statistics.median(best_other),
                        "ratio": ratio,
                        "none_spread": spread(rounds("none", c)),
                        "met": ratio >= 1 - cfg.noise,
                    }
                )
        out["adaptive_loses_nowhere"] = {"cells": rows, "met": all(r["met"] for r in rows)}
    rows = []
    for c in conc:
        base = _cell(cells, "none", c, w)
        for m in SPECULATIVE:
            x = _cell(cells, m, c, w)
            if x and base and base.get("ttft_p50_ms") and x.get("ttft_p50_ms"):
                extra = x["ttft_p50_ms"] / base["ttft_p50_ms"] - 1
                rows.append(
                    {
                        "mode": m,
                        "concurrency": c,
                        "ttft_overhead": round(extra, 3),
                        "met": extra <= 0.20,
                    }
                )
    out["ttft_overhead"] = {"cells": rows, "goal": 0.20, "met": all(r["met"] for r in rows)}
    return out
