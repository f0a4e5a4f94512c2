"""The benchmark stage: every mode served in turn by `dspark endpoint` (a subprocess on
loopback), driven cell by cell by the load client (another subprocess), then the figures side by
side: throughput and TTFT against concurrency, the cost split of a step, the speedup predicted
at concurrency 1 from tau and step costs, and where fixed-k speculation stops paying.

A cell is (mode, concurrency, workload): `requests_per_client` x c requests (at least
`min_requests`), closed loop, after the mode's warm-up requests. All modes' endpoints run at once
(idle ones cost nothing) and each cell is run for every mode in turn, so ratios compare
measurements taken side by side. Each round starts every endpoint afresh, so medians over rounds
sample the process a mode happens to run in, not one process's luck. Around each cell the
server's step counters are read, so each cell knows its steps and where a step's time went
(drafting, verification, accepting, scheduling) and how much of the client's time was not in
steps at all (prefill, HTTP and the rest). Mode `none_vllm` (opt-in) serves vLLM's own server
instead of ours: see `vllm_mode.py`. Modes `llamacpp` and `llamacpp_lookup` serve the peer,
llama.cpp on the same weights, and `vs_llamacpp` sets ours against it: see `llamacpp_mode.py`.

    endpoints.py  a mode's `dspark endpoint` process
    workload.py   the requests and the cells
    measure.py    the measure loop (and transformers' generate, timed alone)
    bench.py      the stage: records, then the figures and goals assembled from the cells
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from dspark.config import BenchmarkConfig, Params, serving_modes
from dspark.progress import say
from dspark.records import Records, fingerprint
from dspark.serve import report
from dspark.serve.llamacpp_mode import ratios as llamacpp_ratios
from dspark.serve.measure import hf_baseline, measure
from dspark.serve.offline import served_vs_offline
from dspark.serve.rounds import paired_ratio, per_round, round_max, spread
from dspark.serve.workload import build_requests
from dspark.stopping import exit_on_sigterm


def speculative() -> tuple[str, ...]:
    """The engine's modes that draft: every one but the target alone."""
    return tuple(m for m in serving_modes() if m != "none")


@dataclass(frozen=True)
class BenchPaths:
    target: Path
    drafts: Path
    prompts: Path
    plots: Path
    report: Path
    logs: Path
    records: Path  # the cells measured so far: the stage's checkpoint
    code: tuple[str, ...] = ()  # the stage's DVC deps: the library code its records depend on
    offline: Path | None = None  # the evaluate stage's metrics: offline tau beside served tau


def bench_records(params: Params, paths: BenchPaths) -> Records:
    """The cells measured so far by a run with the same params, inputs and serving code."""
    from dspark.models.target import read_manifest

    basis = {  # the stage's DVC params, and the target's weights
        "params": params.model_dump(
            mode="json", include={"target", "provision", "serve", "benchmark"}
        ),
        "block_size": params.train.dspark.block_size,
        "target": read_manifest(paths.target),
    }
    drafted = sorted(paths.drafts.glob("*/*")) if paths.drafts.is_dir() else []
    return Records(paths.records, fingerprint(basis, [*drafted, paths.prompts], paths.code))


def benchmark_stage(
    params: Params, paths: BenchPaths, root: Path, log=say, progress: bool = True
) -> dict:
    from dspark.models.target import load_target_for

    # A SIGTERM (a cancelled flow, a killed `dvc repro`) unwinds through the `with` blocks,
    # which stop the endpoint and free its port.
    with exit_on_sigterm():
        target = load_target_for(params.target, paths.target)
        requests = build_requests(params, target, paths.prompts)
        single = None
        if params.benchmark.hf_baseline:

            def single():
                return hf_baseline(params, target, requests[params.benchmark.workload])

        verify_costs: list[dict] = []
        records = bench_records(params, paths)
        # An earlier, stopped run's measurements (one mode's cell in one round; each was
        # measured side by side with the other modes of its cell and round).
        resumed = sum(len(r["cells"]) for r in records.done.values())
        cells = measure(
            params,
            requests,
            target=paths.target,
            drafts=paths.drafts,
            logs=paths.logs,
            root=root,
            log=log,
            progress=progress,
            single=single,
            verify_costs=verify_costs,
            records=records,
        )
    result = assemble(params, cells)
    # {mode: {"tokens": [...], "ms": [...]}} as profiled at the start that measured last; every
    # earlier start (each round starts its endpoints afresh, and a resumed run's earlier
    # starts) profiled its own, kept in `verify_cost_earlier`.
    result["verify_cost"] = verify_costs[-1] if verify_costs else {}
    if len(verify_costs) > 1:
        result["verify_cost_earlier"] = verify_costs[:-1]
    result["resumed_cells"] = resumed
    if paths.offline is not None and paths.offline.is_file():
        offline = json.loads(paths.offline.read_text())
        result["served_vs_offline"] = served_vs_offline(
            cells,
            offline,
            params.benchmark.workload,
            params.benchmark.mixed_concurrency,
            params.benchmark.max_tokens,
        )
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
    for m in speculative():
        x = _cell(cells, m, 1, w)
        if x and none1 and x.get("tau") and x.get("step_ms") and none1.get("step_ms"):
            predicted[m] = round(x["tau"] * none1["step_ms"] / x["step_ms"], 3)
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
        "vs_llamacpp": llamacpp_ratios(cells, ("none", *speculative())),
    }


def goals(cfg: BenchmarkConfig, cells, conc, rounds, baseline, best, predicted) -> dict:
    w, want = cfg.workload, cfg.goals
    out: dict = {}
    if best:
        speedup = _cell(cells, best, 1, w)["speedup"]
        out["single_stream"] = {
            "mode": best,
            "speedup": speedup,
            "goal": want.single_stream_speedup,
            "met": bool(speedup and speedup >= want.single_stream_speedup),
        }
        if best in predicted and speedup:
            ratio = round(speedup / predicted[best], 3)
            out["measured_vs_predicted"] = {
                "ratio": ratio,
                "goal": want.measured_vs_predicted,
                "met": ratio >= want.measured_vs_predicted,
            }
    # The modes that choose per step (DSpark's cost model, the hybrid's proposer) should be at
    # least the best of every other mode of ours, the target alone included, at every
    # concurrency: round by round, within the noise.
    choosers = [m for m in ("dspark_adaptive", "hybrid") if m in cfg.modes]
    ours = [m for m in ("none", "none_hf", *speculative()) if m in (*cfg.modes, "none_hf")]
    if choosers:
        rows = []
        for m in choosers:
            for c in conc:
                best_other = round_max(*(rounds(o, c) for o in ours if o != m))
                ratio = paired_ratio(rounds(m, c), best_other)
                if ratio is not None:
                    rows.append(
                        {
                            "mode": m,
                            "concurrency": c,
                            "tok_s": _cell(cells, m, c, w)["tok_s"],
                            "best_other": statistics.median(best_other),
                            "ratio": ratio,
                            "none_spread": spread(rounds("none", c)),
                            "met": ratio >= 1 - cfg.noise,
                        }
                    )
        out["adaptive_loses_nowhere"] = {"cells": rows, "met": all(r["met"] for r in rows)}
    # The best speculative mode over the target alone, single stream and in the mixed cell.
    cases = [("best_over_none_c1", 1, w, want.best_over_none_c1)]
    if cfg.mixed_concurrency:
        cases.append(
            ("best_over_none_mixed", cfg.mixed_concurrency, "mix", want.best_over_none_mixed)
        )
    for key, c, workload, goal in cases:
        ratios = {
            m: paired_ratio(rounds(m, c, workload), baseline(c, workload))
            for m in speculative()
            if _cell(cells, m, c, workload)
        }
        ratios = {m: r for m, r in ratios.items() if r is not None}
        if ratios:
            top = max(ratios, key=ratios.get)
            out[key] = {"mode": top, "ratio": ratios[top], "goal": goal, "met": ratios[top] >= goal}
    rows = []
    for c in conc:
        base = _cell(cells, "none", c, w)
        for m in speculative():
            x = _cell(cells, m, c, w)
            if x and base and base.get("ttft_p50_ms") and x.get("ttft_p50_ms"):
                extra = x["ttft_p50_ms"] / base["ttft_p50_ms"] - 1
                rows.append(
                    {
                        "mode": m,
                        "concurrency": c,
                        "ttft_overhead": round(extra, 3),
                        "met": extra <= want.ttft_overhead,
                    }
                )
    out["ttft_overhead"] = {
        "cells": rows,
        "goal": want.ttft_overhead,
        "met": all(r["met"] for r in rows),
    }
    return out
