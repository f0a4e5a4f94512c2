"""The evaluation's tables and plots: tau per category and method, per-position acceptance, the
confidence calibration curve (CSV for DVC plots, PNG for people), and a markdown report that puts
the seed's published figures beside ours."""

from __future__ import annotations

from pathlib import Path

from dspark.config import CATEGORIES
from dspark.io import atomic_path, write_csv, write_text

# The seed's published figures (Kimi K3 on GB300, its own DSpark draft).
SEED = {"mean": 4.11, "math_reasoning": 6.42, "HumanEval": 4.96, "long_context": 5.31}
SETUP_NOTE = (
    "The seed measured a 5-layer DSpark draft for Kimi K3 (a trillion-parameter MoE) trained on "
    "its own large corpus, with a 378K-token LongBench-v2 case. Here the target is SmolLM2-135M, "
    "the drafts are trained on the profile's samples only, and long_context is as long as "
    "SmolLM2's 8192 positions allow. The figures answer to the seed's method, not its scale."
)


def write_plots(result: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cats = list(result["categories"])
    methods = list(result["mean"])
    tau_rows = [
        {"category": c, "method": m, "tau": result["categories"][c][m]["tau"]}
        for c in cats
        for m in methods
    ]
    write_csv(folder / "eval_tau.csv", tau_rows)
    pos_rows = [
        {"method": m, "slot": j, "accept": a}
        for m in methods
        for j, a in enumerate(result["overall"][m]["pos_accept"])
        if a is not None
    ]
    write_csv(folder / "eval_pos_accept.csv", pos_rows or [{"method": "", "slot": 0, "accept": 0}])
    curve = result["calibration"].get("curve", [])
    write_csv(
        folder / "eval_calibration.csv",
        curve or [{"bin": 0, "n": 0, "predicted": 0, "observed": 0}],
    )

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [k + i * width for k in range(len(cats))]
        axes[0].bar(xs, [result["categories"][c][m]["tau"] for c in cats], width, label=m)
    axes[0].set_xticks(
        [k + 0.4 - width / 2 for k in range(len(cats))], cats, rotation=45, ha="right"
    )
    axes[0].set_ylabel("tau (tokens per target step)")
    axes[0].set_title("acceptance length per category")
    axes[0].legend()
    for m in methods:
        acc = [a for a in result["overall"][m]["pos_accept"] if a is not None]
        if acc:
            axes[1].plot(range(len(acc)), acc, marker="o", label=m)
    axes[1].set_xlabel("draft slot")
    axes[1].set_ylabel("P(accepted | earlier slots accepted)")
    axes[1].set_title("per-position acceptance")
    if axes[1].lines:  # the target alone drafts nothing
        axes[1].legend()
    if curve:
        axes[2].plot(
            [c["predicted"] for c in curve],
            [c["observed"] for c in curve],
            marker="o",
            label="dspark",
        )
    axes[2].plot([0, 1], [0, 1], linestyle="--", color="grey")
    axes[2].set_xlabel("predicted confidence")
    axes[2].set_ylabel("observed acceptance")
    axes[2].set_title(f"calibration (ECE {result['calibration'].get('ece', 'n/a')})")
    fig.tight_layout()
    with atomic_path(folder / "eval.png") as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)


VERDICTS = {
    "met": "met (the whole interval clears it)",
    "missed": "missed (the whole interval falls short)",
    "straddles": "not shown: the interval straddles the goal",
}


def _tau_cell(tau: float | None, ci: list[float] | None) -> str:
    if tau is None:
        return "n/a"
    return f"{tau:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{tau:.2f}"


def report_markdown(result: dict) -> str:
    methods = list(result["mean"])
    lines = [
        f"# Evaluation ({result.get('profile', '')} profile)",
        "",
        "tau = tokens emitted per target verify step (accepted drafts + the target's token); "
        "greedy, replayed on the target's greedy path (dspark.decode.replay), "
        "[95% bootstrap interval over the prompts].",
        "",
        *_tau_table(result, methods),
        *_pairs_table(result),
        "",
        *_speed_table(result, methods),
        "",
        *_beside_seed(result),
        "",
        SETUP_NOTE,
        "",
        *_checks(result),
        *_findings(result),
    ]
    return "\n".join(lines) + "\n"


def _tau_table(result: dict, methods: list[str]) -> list[str]:
    """tau per category and method, and the mean of the nine."""
    lines = [
        "| category | prompts | tokens | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for c, row in result["categories"].items():
        cells = " | ".join(_tau_cell(row[m]["tau"], row[m].get("tau_ci95")) for m in methods)
        tokens = row[methods[0]].get("tokens", "")
        lines.append(f"| {c} | {result['prompts'].get(c, '')} | {tokens} | {cells} |")
    ci = result.get("mean_ci95", {})
    means = " | ".join(f"**{_tau_cell(result['mean'][m], ci.get(m))}**" for m in methods)
    lines.append(f"| mean of the nine | | | {means} |")
    return lines


def _pairs_table(result: dict) -> list[str]:
    """The paired ratios of mean tau, on the same prompts."""
    if not result.get("pairs"):
        return []
    lines = ["", "| mean tau over mean tau, same prompts | ratio | 95% interval |", "|---|---|---|"]
    for name, p in result["pairs"].items():
        lo, hi = p["ci95"] or ("n/a", "n/a")
        lines.append(f"| {name} | {p['ratio']} | [{lo}, {hi}] |")
    return lines


def _speed_table(result: dict, methods: list[str]) -> list[str]:
    lines = [
        "| method | tok/s (live decodes) | speedup vs none | draft share | distinct-2 |",
        "|---|---|---|---|---|",
    ]
    for m in methods:
        o = result["overall"][m]
        lines.append(
            f"| {m} | {o['tok_s']} | {o.get('speedup', 'n/a')} | {o['draft_share']} "
            f"| {o['distinct_2']} |"
        )
    return lines


def _beside_seed(result: dict) -> list[str]:
    """DSpark's figures beside the paper's (SEED)."""
    lines = ["## Beside the seed", "", "| figure | seed | ours (dspark) |", "|---|---|---|"]
    ours = {
        "mean": result["mean"].get("dspark"),
        **{
            c: result["categories"].get(c, {}).get("dspark", {}).get("tau")
            for c in SEED
            if c != "mean"
        },
    }
    for key, seed in SEED.items():
        val = ours.get(key)
        lines.append(f"| {key} | {seed} | {val if val is not None else 'n/a'} |")
    return lines


def _checks(result: dict) -> list[str]:
    """What holds the figures up: losslessness, replay against live decoding, sampling, lm-eval
    and DSpark's confidence calibration."""
    lossless = result["lossless"]
    lines = [
        f"Lossless: {result['lossless_mismatches']} mismatches, {result['lossless_ties']} ties "
        f"over {lossless.get('positions', 0)} recorded positions and "
        f"{lossless.get('checked', 0)} live greedy outputs checked against transformers."
    ]
    check = result.get("replay_check")
    if check and check["decodes"]:
        lines.append(
            f"Replay against live decoding: {check['same']} of {check['decodes']} live greedy "
            "decodes took the same steps as their replay"
            + (f" (differ: {', '.join(check['differ'][:5])})." if check["differ"] else ".")
        )
    if "sampling" in result:
        s = result["sampling"]
        taus = ", ".join(f"{m} {t}" for m, t in s["mean"].items())
        lines.append(
            f"Sampling (temperature {s['temperature']}, top-p {s['top_p']}): mean tau {taus}."
        )
    if "quality" in result:
        q = result["quality"]
        em = ", ".join(f"{m} {v:.3f}" for m, v in q["exact_match"].items())
        same = "identical" if q["identical_outputs"] else "NOT identical"
        lines.append(f"lm-eval {q['task']} on {q['limit']} problems: {em}; outputs {same}.")
    cal = result["calibration"]
    if cal:
        lines.append(f"DSpark confidence: ECE {cal['ece']} over {cal['n']} reached slots.")
    return lines


def _findings(result: dict) -> list[str]:
    """The n-gram window, the goals, the Markov ablation, where DSpark trails, the stage's
    time, and what was not evaluated."""
    lines = []
    if result.get("ngram_window"):
        lines.append(
            f"n-gram window (min, max) chosen by the sweep: {tuple(result['ngram_window'])}; "
            f"sweep taus {result['ngram_sweep']}."
        )
    for name, g in result.get("goals", {}).items():
        interval = f" [{g['ci95'][0]}, {g['ci95'][1]}]" if g.get("ci95") else ""
        lines.append(
            f"Goal {name}: {g['ratio']}{interval} (goal {g['goal']}): "
            + VERDICTS.get(g.get("verdict"), "met" if g["met"] else "not met")
            + "."
        )
    if "markov_ablation" in result:
        abl = ", ".join(f"{v} {d['mean_tau']}" for v, d in result["markov_ablation"].items())
        lines.append(f"Markov ablation, mean tau: {abl}.")
    for rival in ("eagle3", "dflash", "ngram"):
        behind = [
            c
            for c, row in result["categories"].items()
            if rival in row
            and "dspark" in row
            and (row["dspark"]["tau"] or 0) < (row[rival]["tau"] or 0)
        ]
        if behind:
            lines.append(f"DSpark's tau is below {rival}'s on: {', '.join(behind)}.")
    if "phases_s" in result:
        parts = ", ".join(f"{k.replace('_', ' ')} {v} s" for k, v in result["phases_s"].items())
        lines.append(f"Stage time by phase: {parts}.")
    if "paths_s" in result:
        split = result["paths_s"]
        parts = ", ".join(
            f"{part} {split[f'{part}_short']} s short, {split[f'{part}_long']} s long"
            for part in ("prefill", "decode", "check")
        )
        lines.append(
            f"The target's paths by part (ours: prefill, decode; transformers: check): {parts}."
        )
    missing = [c for c in CATEGORIES if c not in result["categories"]]
    if missing:
        lines.append(f"Not evaluated: {', '.join(missing)}.")
    return lines


def write_report(result: dict, path: Path) -> None:
    write_text(path, report_markdown(result))
