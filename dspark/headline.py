"""A pipeline run's headline figures, read from the stages' metrics files.

What a pipeline's parent run shows in the MLflow runs table, so that two runs compare without
opening their children. Files in, two dicts out (the tracking code logs them); only
`write_table`, below, writes.

    metrics                       from        what
    tau_mean.<method>             eval.json   mean over categories of tokens per verify step
                                              (every method but `none`, the plain target)
    lossless_mismatches           eval.json   checked decodes whose output differs from the target's
    speedup_c1.<mode>             bench.json  single-stream tok/s over the plain target's (`none`)
    tau_sim.<draft>               train.json  held-out acceptance length each trained draft reaches
    tau_greedy.<draft>            train.json  the same under greedy decoding (as evaluate decodes)
    total_wall_s                  run.json    every stage's wall time, summed
    total_cpu_s                   run.json    every stage's CPU time (its children's too), summed

    tags: profile and git_commit (run.json, else the first file holding them); cached_stages.

A file that is missing, unreadable or written for another profile contributes nothing: a stage
skipped as cached still has its file from the run that computed it, and contributes.

The headline table (`table`, `write_table`) is the same figures for a terminal: a folder
`headline/` beside the metrics files it is read from (metrics/headline/ for the working profile,
metrics/full/headline/ for the committed full run), one small file per row, keyed by method, so
that `dvc metrics show -R metrics/headline metrics/full/headline` prints a row per figure and a
column per method within 100 columns. Its files carry no profile or commit stamp (a 40-character
commit would be a column of its own); the run.json beside them says which run they are.

    row            column    from          what
    tau            method    eval.json     mean tau of the nine categories
    dspark_over    method    eval.json     DSpark's mean tau over the method's, on the same prompts
    speedup        method    bench.json    single-stream tok/s over `none`'s (HTTP, c=1); a
                                           method served in several modes shows its best;
                                           llama.cpp, the peer, is no method of ours (its
                                           ratios: bench.json `vs_llamacpp`)
    tau_decode     draft     train.json    held-out tau as greedy decoding walks it
    train_tok_s    draft     train.json    the trainer's tokens/s
    data_tok_s     target    extract.json  tokens/s the data plane delivered (the target answering
                                           and capturing)
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.io import write_json

FILES = {
    "train": "train.json",
    "eval": "eval.json",
    "bench": "bench.json",
    "run": "run.json",
    "extract": "extract.json",
}
BASELINE_MODE = "none"  # the plain target: tau and speedup 1 by definition, so not headlines
# The peer server's modes (dspark.serve.llamacpp_mode.MODES): no column of the table, which has
# one per method of ours and fits 100 columns with no more.
PEER_MODES = ("llamacpp", "llamacpp_lookup")
HELD_OUT = (  # train.json's per-draft held-out figures, each a summary line where present
    ("tau_sim", "held-out tau_sim after training"),
    ("tau_greedy", "held-out greedy tau after training"),
    ("tau_decode", "held-out tau as greedy decoding walks it"),
)


HEADLINE_DIR = "headline"  # the table's folder, beside the metrics files it is read from
TABLE_ROWS = ("tau", "dspark_over", "speedup", "tau_decode", "train_tok_s", "data_tok_s")
DATA_COLUMN = "target"  # data_tok_s's one column: the target answers and captures the data


def read_docs(folder: Path, profile: str | None = None) -> dict[str, dict]:
    """{"train"|"eval"|"bench"|"run"|"extract": the parsed file} for those present in `folder`
    (written for `profile`, when given)."""
    docs = {}
    for key, name in FILES.items():
        try:
            doc = json.loads((Path(folder) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and (profile is None or doc.get("profile") == profile):
            docs[key] = doc
    return docs


def headline(docs: dict[str, dict]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) from `read_docs`' result."""
    metrics: dict[str, float] = {}
    ev, bench, train, run = (docs.get(k) or {} for k in ("eval", "bench", "train", "run"))
    for method, tau in (ev.get("mean") or {}).items():
        if method != BASELINE_MODE:
            _put(metrics, f"tau_mean.{method}", tau)
    lossless = ev.get("lossless")
    mismatches = lossless.get("mismatches") if isinstance(lossless, dict) else None
    _put(metrics, "lossless_mismatches", ev.get("lossless_mismatches", mismatches))
    for mode, row in (bench.get("overall") or {}).items():
        if mode != BASELINE_MODE and isinstance(row, dict):
            _put(metrics, f"speedup_c1.{mode}", row.get("speedup_c1"))
    for draft, block in train.items():
        if isinstance(block, dict) and "tau_sim" in block:
            _put(metrics, f"tau_sim.{draft}", block["tau_sim"])
            _put(metrics, f"tau_greedy.{draft}", block.get("tau_greedy"))
    _put(metrics, "total_wall_s", run.get("total_wall_s"))
    _put(metrics, "total_cpu_s", run.get("total_cpu_s"))

    tags: dict[str, str] = {}
    for key in ("profile", "git_commit"):
        value = next((d[key] for d in (run, ev, bench, train) if d.get(key)), None)
        if value:
            tags[key] = str(value)
    stages = run.get("stages") or {}
    if any(isinstance(s, dict) and "cached" in s for s in stages.values()):
        tags["cached_stages"] = ",".join(n for n, s in stages.items() if s.get("cached")) or "-"
    return metrics, tags


def _put(out: dict[str, float], key: str, value) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        out[key] = float(value)


def _interval(ci, digits: int = 2) -> str:
    if not (isinstance(ci, list | tuple) and len(ci) == 2):
        return ""
    return f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def summary(
    docs: dict[str, dict],
    mlflow: str,
    profile: str,
    folder: str = "metrics",
    full: tuple[str, dict[str, dict]] | None = None,
) -> str:
    """What a pipeline run ends by printing: where the time went, tau per method with its
    interval, the pairs, the single-stream speedup over `none`, the headline table beside the
    committed full run's, and where to look next. `mlflow` is how to reach the tracking UI (a
    link, or the command that serves the store); `folder` is where the metrics files are,
    relative to the repository; `full` is (the folder, `read_table`) of the full run's table,
    so a small run shows what it stands for."""
    ev, bench, train, run = (docs.get(k) or {} for k in ("eval", "bench", "train", "run"))
    lines = [f"dspark {profile} run"]
    stages = run.get("stages") or {}
    if stages:
        parts = ", ".join(
            f"{name} {s['wall_s']:.0f} s" + (" (cached)" if s.get("cached") else "")
            for name, s in stages.items()
            if isinstance(s, dict) and isinstance(s.get("wall_s"), int | float)
        )
        cpu = run.get("total_cpu_s")
        on_cores = f" ({cpu:,.0f} CPU-seconds)" if isinstance(cpu, int | float) else ""
        lines.append(f"  stages: {run.get('total_wall_s', 0):.0f} s in all{on_cores}: {parts}")
    mean, ci = ev.get("mean") or {}, ev.get("mean_ci95") or {}
    if mean:
        taus = ", ".join(
            f"{m} {t:.2f}{_interval(ci.get(m))}"
            for m, t in mean.items()
            if t is not None and m != BASELINE_MODE
        )
        lines.append(f"  tau (mean of the nine categories, 95% interval): {taus}")
    if ev.get("pairs"):
        pairs = ", ".join(
            f"{name} {p['ratio']:.3f}{_interval(p.get('ci95'), 3)}"
            for name, p in ev["pairs"].items()
        )
        lines.append(f"  tau ratios, same prompts: {pairs}")
    drafts = {d: b for d, b in train.items() if isinstance(b, dict)}
    for key, label in HELD_OUT:
        held = ", ".join(f"{d} {b[key]:.3f}" for d, b in drafts.items() if b.get(key) is not None)
        if held:  # (older runs lack the later figures)
            lines.append(f"  {label}: {held}")
    lossless = ev.get("lossless")
    if isinstance(lossless, dict):
        lines.append(
            f"  lossless: {lossless.get('mismatches')} mismatches, {lossless.get('ties')} ties "
            f"over {lossless.get('positions')} path positions"
        )
    speedups = {
        m: row["speedup_c1"]
        for m, row in (bench.get("overall") or {}).items()
        if m != BASELINE_MODE and isinstance(row, dict) and row.get("speedup_c1") is not None
    }
    if speedups:
        best = max(speedups, key=speedups.get)
        each = ", ".join(f"{m} {s:.2f}x" for m, s in speedups.items())
        lines.append(f"  single stream over none (HTTP, c=1): {each}; best {best}")
    if full and full[1]:
        lines += _beside(table(docs), full[1], full[0])
    lines += [
        "  where to look:",
        f"    MLflow: {mlflow}",
        f"    reports: {folder}/eval_report.md, {folder}/bench_report.md",
        "    plots: plots/train_curves.png, plots/eval.png, plots/bench.png (`dvc plots show`)",
        f"    every figure: {folder}/*.json; reproduce: dvc repro",
    ]
    return "\n".join(lines)


def table(docs: dict[str, dict]) -> dict[str, dict[str, float | int]]:
    """The headline table from `read_docs`' result: {row: {column: figure}}, rows in TABLE_ROWS'
    order and only those with a figure. Ratios and taus keep three decimals, rates none."""
    ev, bench, train, extract = (docs.get(k) or {} for k in ("eval", "bench", "train", "extract"))
    rows: dict[str, dict[str, float | int]] = {row: {} for row in TABLE_ROWS}
    for method, tau in (ev.get("mean") or {}).items():
        if method != BASELINE_MODE and _number(tau):
            rows["tau"][method] = round(tau, 3)
    for pair, p in (ev.get("pairs") or {}).items():
        over, _, method = pair.partition("/")
        if over == "dspark" and isinstance(p, dict) and _number(p.get("ratio")):
            rows["dspark_over"][method] = round(p["ratio"], 3)
    for mode, row in (bench.get("overall") or {}).items():
        method = mode.split("_", 1)[0]  # dspark_fixed, dspark_adaptive: DSpark's modes
        speedup = row.get("speedup_c1") if isinstance(row, dict) else None
        if method != BASELINE_MODE and mode not in PEER_MODES and _number(speedup):
            rows["speedup"][method] = round(max(speedup, rows["speedup"].get(method, speedup)), 3)
    for draft, block in train.items():
        if isinstance(block, dict) and _number(block.get("tau_decode")):
            rows["tau_decode"][draft] = round(block["tau_decode"], 3)
        if isinstance(block, dict) and _number(block.get("tokens_per_s")):
            rows["train_tok_s"][draft] = round(block["tokens_per_s"])
    if _number(extract.get("tok_s")):
        rows["data_tok_s"][DATA_COLUMN] = round(extract["tok_s"])
    return {row: figures for row, figures in rows.items() if figures}


def read_table(folder: Path) -> dict[str, dict[str, float | int]]:
    """The headline table `write_table` left under folder/headline/: {row: {column: figure}},
    the rows with a readable file, in TABLE_ROWS' order."""
    rows = {}
    for row in TABLE_ROWS:
        try:
            figures = json.loads((Path(folder) / HEADLINE_DIR / f"{row}.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(figures, dict):
            rows[row] = {k: v for k, v in figures.items() if _number(v)}
    return rows


def _beside(mine: dict[str, dict], full: dict[str, dict], where: str) -> list[str]:
    """The headline table as `this run / the full run`, a column per method (-: no figure);
    the data plane's one figure on a line of its own."""
    rows = [r for r in TABLE_ROWS if r in mine or r in full]
    grid = [r for r in rows if r != "data_tok_s"]
    columns = list(dict.fromkeys(c for t in (mine, full) for r in grid for c in t.get(r, {})))

    def cell(row: str, column: str) -> str:
        a, b = (t.get(row, {}).get(column) for t in (mine, full))
        return " / ".join("-" if v is None else f"{v:,}" for v in (a, b))

    lines = [
        f"  headline, this run / the committed full run ({where}/{HEADLINE_DIR}):",
        ("    " + " " * 12 + "".join(f"{c:<16}" for c in columns)).rstrip(),
    ]
    for row in grid:
        lines.append((f"    {row:<12}" + "".join(f"{cell(row, c):<16}" for c in columns)).rstrip())
    if "data_tok_s" in rows:
        lines.append(f"    {'data_tok_s':<12}{DATA_COLUMN} {cell('data_tok_s', DATA_COLUMN)}")
    return lines


def write_table(folder: Path, docs: dict[str, dict]) -> dict[str, dict[str, float | int]]:
    """Write `table(docs)` into folder/headline/, a file per row; a row with no figure this time
    loses its file, so the folder never shows another run's figure."""
    rows = table(docs)
    out = Path(folder) / HEADLINE_DIR
    for row in TABLE_ROWS:
        path = out / f"{row}.json"
        if row in rows:
            write_json(path, rows[row])
        else:
            path.unlink(missing_ok=True)
    return rows


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
