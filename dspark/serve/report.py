"""The benchmark's table (printed), markdown report, CSVs and PNG."""

from __future__ import annotations

from pathlib import Path

from dspark.io import atomic_path, write_csv, write_text

COLUMNS = (
    ("mode", "mode", 16),
    ("concurrency", "c", 3),
    ("workload", "workload", 15),
    ("tok_s", "tok/s", 7),
    ("speedup", "x none", 6),
    ("request_tok_s", "req tok/s", 9),
    ("ttft_p50_ms", "TTFT p50", 8),
    ("ttft_p99_ms", "TTFT p99", 8),
    ("itl_p50_ms", "ITL p50", 7),
    ("itl_p99_ms", "ITL p99", 7),
    ("tau", "tau", 5),
    ("draft_share", "draft %", 7),
    ("distinct_2", "dist-2", 6),
)


# Where a step's time went, ms per engine step (dspark.serve.measure.step_costs): the step's
# parts add up to `step`; `prefill` and `other` (HTTP and the rest of the client's wall time)
# fall between steps.
COST_COLUMNS = (
    ("mode", "mode", 16),
    ("concurrency", "c", 3),
    ("workload", "workload", 15),
    ("draft_ms", "draft", 7),
    ("verify_ms", "verify", 7),
    ("accept_ms", "accept", 7),
    ("schedule_ms", "sched", 7),
    ("step_ms", "step", 7),
    ("prefill_ms", "prefill", 7),
    ("other_ms", "HTTP+", 7),
)


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key == "draft_share":
        return f"{100 * v:.0f}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _rows(cells: list[dict], columns) -> list[str]:
    head = " ".join(f"{label:>{w}}" for _, label, w in columns)
    lines = [head, "-" * len(head)]
    for x in sorted(cells, key=lambda x: (x["workload"], x["concurrency"], x["mode"])):
        lines.append(" ".join(f"{_fmt(k, x.get(k)):>{w}}" for k, _, w in columns))
    return lines


def cost_table(result: dict) -> list[str]:
    """A step's cost split per cell, ms per engine step (cells with steps only)."""
    cells = [x for x in result["cells"] if x.get("step_ms") is not None]
    if not cells:
        return []
    note = "ms per engine step: draft + verify + accept + sched = step; prefill, HTTP+ apart"
    return ["", note, *_rows(cells, COST_COLUMNS)]


def table(result: dict) -> str:
    lines = _rows(result["cells"], COLUMNS)
    lines.extend(cost_table(result))
    lines.append(
        f"predicted single-stream speedup: {result['predicted_speedup_c1']} "
        f"(by mode {result['predicted_speedup_c1_by_mode']}); "
        f"fixed-k stops paying at concurrency {result['crossover_concurrency']}"
    )
    lines.extend(goal_lines(result["goals"]))
    lines.extend(peer_lines(result.get("vs_llamacpp") or []))
    return "\n".join(lines)


def peer_lines(rows: list[dict]) -> list[str]:
    """bench.json's `vs_llamacpp`: ours over llama.cpp plain on the same weights, per cell."""
    if not rows:
        return []
    out = ["", "over llama.cpp plain, same weights (medians of same-round ratios):"]
    head = f"{'c':>3} {'workload':>15} {'llama.cpp':>9} {'none':>6} {'best mode':>16} "
    out.append(head + f"{'best':>6} {'lookup':>7}")
    for r in rows:
        out.append(
            f"{r['concurrency']:>3} {r['workload']:>15} {_fmt('tok_s', r['llamacpp_tok_s']):>9} "
            f"{_fmt('', r['none_over_llamacpp']):>6} {_fmt('', r['best_mode']):>16} "
            f"{_fmt('', r['best_over_llamacpp']):>6} {_fmt('', r['lookup_over_plain']):>7}"
        )
    return out


def goal_lines(g: dict) -> list[str]:
    out = []
    if "single_stream" in g:
        s = g["single_stream"]
        out.append(
            f"goal single stream >= {s['goal']}x none: {s['mode']} {s['speedup']}x "
            f"({'met' if s['met'] else 'NOT met'})"
        )
    if "measured_vs_predicted" in g:
        s = g["measured_vs_predicted"]
        out.append(
            f"goal measured >= {100 * s['goal']:.0f}% of predicted: {100 * s['ratio']:.0f}% "
            f"({'met' if s['met'] else 'NOT met'})"
        )
    if "adaptive_loses_nowhere" in g:
        s = g["adaptive_loses_nowhere"]
        lost = [f"{r['mode']} c={r['concurrency']}" for r in s["cells"] if not r["met"]]
        worst = min(s["cells"], key=lambda r: r["ratio"], default=None)
        moved = [r["none_spread"] for r in s["cells"] if r.get("none_spread") is not None]
        detail = (
            f"; worst {worst['mode']} {worst['ratio']}x at c={worst['concurrency']}"
            if worst
            else ""
        )
        if moved:
            detail += f"; none moved up to {100 * max(moved):.0f}% between rounds"
        out.append(
            "goal adaptive and hybrid >= every other mode at every concurrency: "
            + ("met" if s["met"] else f"NOT met at {', '.join(lost)}")
            + detail
        )
    for key, where in (("best_over_none_c1", "c=1"), ("best_over_none_mixed", "the mixed cell")):
        if key in g:
            s = g[key]
            out.append(
                f"goal best mode >= {s['goal']}x none at {where}: {s['mode']} {s['ratio']}x "
                f"({'met' if s['met'] else 'NOT met'})"
            )
    s = g.get("ttft_overhead")
    if s and s["cells"]:
        worst = max(s["cells"], key=lambda r: r["ttft_overhead"])
        out.append(
            f"goal TTFT overhead <= {100 * s['goal']:.0f}%: "
            f"worst {100 * worst['ttft_overhead']:.0f}% "
            f"({worst['mode']} at c={worst['concurrency']}; {'met' if s['met'] else 'NOT met'})"
        )
    return out


def write_plots(result: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    w = result["workload"]
    sweep = [x for x in result["cells"] if x["workload"] == w]
    rows = [
        {
            "mode": x["mode"],
            "concurrency": x["concurrency"],
            "tok_s": x["tok_s"],
            "ttft_p50_ms": x.get("ttft_p50_ms"),
        }
        for x in sweep
    ]
    write_csv(folder / "bench.csv", rows or [{"mode": "", "concurrency": 0, "tok_s": 0}])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(x["mode"] for x in sweep):
        pts = sorted((x["concurrency"], x) for x in sweep if x["mode"] == mode)
        marker = "s" if len(pts) == 1 else "o"
        axes[0].plot([c for c, _ in pts], [x["tok_s"] for _, x in pts], marker=marker, label=mode)
        ttft = [(c, x["ttft_p50_ms"]) for c, x in pts if x.get("ttft_p50_ms") is not None]
        if ttft:
            axes[1].plot(*zip(*ttft, strict=True), marker=marker, label=mode)
    for ax, label in ((axes[0], "aggregate output tok/s"), (axes[1], "median TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    axes[0].set_title(f"throughput ({w}, {result['max_tokens']} tokens max)")
    axes[1].set_title("time to first token")
    fig.tight_layout()
    with atomic_path(folder / "bench.png") as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)


def write_report(result: dict, path: Path) -> None:
    lines = [
        "# Benchmark",
        "",
        f"Workload `{result['workload']}`, outputs capped at {result['max_tokens']} tokens.",
        "",
        "```",
        table(result),
        "```",
        "",
        "The seed's figures (GB300, Kimi K3): single stream 110 -> 435 tok/s (3.95x); "
        "concurrency 1 -> 16 aggregate 177 -> 683 tok/s, median TTFT 379 -> 479 ms.",
        *served_lines(result.get("served_vs_offline", [])),
    ]
    write_text(path, "\n".join(lines) + "\n")


def served_lines(rows: list[dict]) -> list[str]:
    """Served tau beside the evaluation's (offline) tau of the same method: on the very prompts
    the cell served where the evaluation has them, and the category's for context."""
    if not rows:
        return []
    out = [
        "",
        "## Served beside offline acceptance",
        "",
        "| mode | category | concurrency | served tau | offline, same prompts "
        "| offline, category [95%] | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ci = r["offline_ci95"]
        interval = f" [{ci[0]}, {ci[1]}]" if ci else ""
        same = r.get("offline_same_prompts")
        note = "differs on the same prompts" if r["gap"] else ""
        if r.get("expected"):
            note += f" (expected: {r['expected']})"
        out.append(
            f"| {r['mode']} | {r['category']} | {r['concurrency']} | {r['served_tau']} "
            f"| {'-' if same is None else same} | {r['offline_tau']}{interval} | {note} |"
        )
    return out
