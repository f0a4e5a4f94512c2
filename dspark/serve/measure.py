"""The benchmark's measure loop, round by round: every mode's endpoint started afresh and up at
once, then each cell driven by the load client (a subprocess) for every mode in turn, with the
server's step counters read around it; and transformers' generate timed alone, the other
`none`."""

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
from dspark.serve.llamacpp_mode import MODES as LLAMACPP_MODES
from dspark.serve.llamacpp_mode import LlamacppEndpoint
from dspark.serve.rounds import merge_rounds, rotated
from dspark.serve.scheduler import cost_modelled
from dspark.serve.vllm_mode import MODE as VLLM_MODE
from dspark.serve.vllm_mode import VllmEndpoint
from dspark.serve.workload import cell_plan


def run_client(
    url: str, requests: list[dict], concurrency: int, count: int, cfg, tmp: Path, extra=()
):
    """One cell through the load client process -> its raw records."""
    reqs, out = tmp / "requests.json", tmp / "cell.json"
    keep = ("id", "prompt", "text")  # text: for a server that takes no token ids (llama.cpp)
    write_json(reqs, [{k: r[k] for k in keep if k in r} for r in requests])
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
    """Every cell, round by round: each round starts a fresh endpoint per mode (its log in
    `logs`), warms them up and runs each cell mode after mode, in an order rotated by one mode
    each round, then stops them. A cell's modes are measured minutes apart at most, so the
    machine's drift shows in every one alike (on this shared 2-core machine one mode's step
    time moves 15% between loads); and each round measures every mode in a new process, so
    the medians over rounds also sample the luck of the process (the same one-token step
    differs by up to 30% from one process to the next: benchmarks/decode_step.py). Rounds are
    merged per cell by `rounds.merge_rounds`. `single` measures one more cell beside the
    single-stream ones (transformers' generate). The verify-cost tables the endpoints profiled
    at start ({mode: table}) go into `verify_costs`, one entry per start that measured cells.

    With `records`, each round of a cell is recorded once all its modes are measured (with the
    tables it ran under), and a rerun replays the recorded ones: a stopped benchmark goes on at
    the first cell of the first round it had not finished."""
    verify_costs = [] if verify_costs is None else verify_costs
    cfg = params.benchmark
    plan = cell_plan(params)
    measured = _Measured(plan, cfg.rounds, records)
    for r in measured.recorded.values():
        if r["verify_cost"] not in verify_costs:
            verify_costs.append(r["verify_cost"])
    todo = [(i, p) for i in range(cfg.rounds) for p in measured.left(i)]
    if not todo:
        log(f"all {len(plan)} cells recorded by an earlier run: nothing to measure")
        return measured.merged()
    total = sum(len(cfg.modes) + bool(single and p == (1, cfg.workload)) for _, p in todo)
    runs = bar(total=total, desc="benchmark", unit="runs", enabled=progress)
    with tempfile.TemporaryDirectory() as tmp, contextlib.closing(runs):
        tmp = Path(tmp)
        resolved = tmp / "params.json"
        write_json(resolved, params.model_dump(mode="json"))
        for i in range(cfg.rounds):
            mine = measured.left(i)
            _log_recorded(plan, mine, _round_tag(i, cfg.rounds), log)
            if not mine:
                continue
            # One log per mode and round: logs/<mode>.log, or <mode>.round<i>.log with rounds.
            suffix = f".round{i + 1}" if cfg.rounds > 1 else ""
            up = endpoints_up(params, resolved, target, drafts, logs, root, log, suffix=suffix)
            with up as endpoints:
                tables = {ep.mode: t for ep in endpoints if (t := ep.stats().get("verify_cost"))}
                verify_costs.append(tables)
                warm_up(endpoints, requests, cfg, tmp, log)
                for cell in mine:
                    group = _measure_cell(
                        endpoints, i, cell, params, requests, tmp, single=single, runs=runs, log=log
                    )
                    measured.put(i, cell, group, tables)
    return measured.merged()


class _Measured:
    """Each cell's group (its modes' results) per round, by key: the rounds an earlier run
    recorded, replayed from `records`, and those measured now, each recorded as it is done."""

    def __init__(self, plan: list[tuple[int, str]], rounds: int, records: Records | None):
        self.plan, self.rounds, self.records = plan, rounds, records
        self.recorded = {
            self.key(i, *p): r
            for i in range(rounds)
            for p in plan
            if records and (r := records.get(self.key(i, *p)))
        }
        self.groups: dict[str, list[dict]] = {k: r["cells"] for k, r in self.recorded.items()}

    def key(self, turn: int, concurrency: int, workload: str) -> str:
        cell = f"c={concurrency} {workload}"
        return f"round {turn + 1} {cell}" if self.rounds > 1 else cell

    def left(self, turn: int) -> list[tuple[int, str]]:
        """The round's cells no earlier run recorded, in the plan's order."""
        return [p for p in self.plan if self.key(turn, *p) not in self.recorded]

    def put(self, turn: int, cell: tuple[int, str], group: list[dict], tables: dict) -> None:
        self.groups[self.key(turn, *cell)] = group
        if self.records:
            self.records.put(self.key(turn, *cell), cells=group, verify_cost=tables)

    def merged(self) -> list[dict]:
        """Every cell's rounds merged, cell by cell in the plan's order."""
        per_cell = ([self.groups[self.key(i, *p)] for i in range(self.rounds)] for p in self.plan)
        return [x for groups in per_cell for x in merge_rounds(groups)]


def _round_tag(turn: int, rounds: int) -> str:
    """The log lines' prefix naming the round, when there are several."""
    return f"round {turn + 1}/{rounds}: " if rounds > 1 else ""


def _log_recorded(plan, mine, tag: str, log) -> None:
    """Names the round's cells an earlier run recorded: this one will not measure them."""
    for c, workload in plan:
        if (c, workload) not in mine:
            log(f"{tag}c={c:<3d} {workload:15s} recorded by an earlier run")


def _measure_cell(
    endpoints, turn: int, cell, params: Params, requests, tmp: Path, *, single, runs, log
) -> list[dict]:
    """One cell in every mode of the round, in its rotated order, after `single` (transformers'
    generate, as `none_hf`) where the cell is the single-stream one. Each run advances `runs`
    and logs its result."""
    cfg = params.benchmark
    concurrency, workload = cell
    tag = _round_tag(turn, cfg.rounds)
    group = []
    if single and (concurrency, workload) == (1, cfg.workload):
        group.append(single())
        runs.update(1)
        log(f"{tag}{'none_hf':16s} c=1   {workload:15s} {group[-1]['tok_s']} tok/s")
    for ep in rotated(endpoints, turn):
        x = run_cell(ep, concurrency, workload, params, requests, tmp)
        group.append(x)
        runs.update(1)
        log(
            f"{tag}{ep.mode:16s} c={concurrency:<3d} {workload:15s} "
            f"{x['tok_s']} tok/s, TTFT p50 {x['ttft_p50_ms']} ms, tau {x['tau']}"
        )
    return group


@contextlib.contextmanager
def endpoints_up(
    params: Params, resolved: Path, target, drafts, logs: Path, root: Path, log, suffix: str = ""
):
    """A fresh endpoint per mode, ready, in the order of `benchmark.modes`, each logging to
    `logs/<mode><suffix>.log`; all stopped, their ports freed, on exit. The modes the cost
    model plans time the verify pass at start: each starts alone, after the rest are up, so
    no other process's loading or profiling shares the cores it is timed on."""
    host, modes = params.serve.host, params.benchmark.modes
    started = {}
    quiet = [m for m in modes if cost_modelled(m, params.serve.cost_model)]
    with contextlib.ExitStack() as stack:
        for group in ([m for m in modes if m not in quiet], *([m] for m in quiet)):
            for mode in group:
                log_file = logs / f"{mode}{suffix}.log"
                if mode == VLLM_MODE:
                    ep = VllmEndpoint(params, target, root, host, log_file)
                elif mode in LLAMACPP_MODES:
                    ep = LlamacppEndpoint(mode, params, target, root, host, log_file)
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
        yield [started[m] for m in modes]


def warm_up(endpoints, requests, cfg, tmp: Path, log) -> None:
    if not cfg.warmup_requests:
        return
    log(f"benchmark: warm-up, {cfg.warmup_requests} request(s) per mode")
    for ep in endpoints:
        run_client(ep.url, requests[cfg.workload], 1, cfg.warmup_requests, cfg, tmp, ep.client_args)


def run_cell(ep: EndpointProcess, concurrency: int, workload: str, params, requests, tmp):
    cfg = params.benchmark
    count = max(cfg.min_requests, cfg.requests_per_client * concurrency)
    before = ep.stats()
    raw = run_client(ep.url, requests[workload], concurrency, count, cfg, tmp, ep.client_args)
    after = ep.stats()
    cell = {"mode": ep.mode, "concurrency": concurrency, "workload": workload}
    cell.update(summarize(raw))
    cell.update(step_costs(before, after, raw["wall_s"]))
    cell["cost_model"] = "scheduler" in after  # a cost model planned this mode's drafts
    if cell["errors"]:
        first = next(r["error"] for r in raw["records"] if "error" in r)
        raise RuntimeError(f"{ep.mode} c={concurrency}: {cell['errors']} requests failed: {first}")
    return cell


# A step's parts in the server's stats (dspark.serve.engine.EngineStats), each summed over the
# cell and given per engine step as `<part>_ms`.
STEP_PARTS = ("draft", "verify", "accept", "schedule")


def step_costs(before: dict, after: dict, wall_s: float | None = None) -> dict:
    """Where a cell's time went, in ms per engine step: the step's parts (`draft_ms`,
    `verify_ms`, `accept_ms`, `schedule_ms`, adding up to `step_ms`), `prefill_ms` (admitting
    requests, between steps) and `other_ms`: the client's wall time spent in neither (HTTP,
    tokenizing, the engine idle between a request's end and the next). `draft_share` is the
    draft's share of a step."""
    steps = after["steps"] - before["steps"]
    # Steps that drafted (the cost model skips drafting where it does not pay).
    drafted = after.get("draft_steps", 0) - before.get("draft_steps", 0)
    keys = [f"{p}_ms" for p in (*STEP_PARTS, "step", "prefill", "other")]
    if steps <= 0:
        return {"steps": 0, "draft_steps": 0, **dict.fromkeys(keys), "draft_share": None}

    def spent(key: str) -> float:  # seconds over the cell (older servers lack a key: 0)
        return after.get(key, 0.0) - before.get(key, 0.0)

    step, prefill = spent("step_s"), spent("prefill_s")
    out = {"steps": steps, "draft_steps": drafted}
    for part in (*STEP_PARTS, "step", "prefill"):
        out[f"{part}_ms"] = round(spent(f"{part}_s") * 1000 / steps, 2)
    other = None if wall_s is None else (wall_s - step - prefill) * 1000 / steps
    out["other_ms"] = None if other is None else round(other, 2)
    out["draft_share"] = round(spent("draft_s") / step, 4) if step > 0 else None
    return out


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
