"""Served acceptance beside offline acceptance: the tau each serving mode reached over HTTP,
next to the evaluate stage's tau for the same method on the same category, with the offline
95% interval over prompts. A served tau outside that interval is a gap worth a look (a user's
"good validation, poor serving acceptance"); the adaptive mode verifies fewer drafts than it
proposes by design, so its gap is expected and said so.

The benchmark's workload is one category (its cells at concurrency 1 are compared); the mixed
cell draws on all nine, so its offline side pools the nine categories' prompts.
"""

from __future__ import annotations

from dspark.config import CATEGORIES
from dspark.evaluate.stats import pooled_tau, tau_interval

# serving mode -> the evaluated method that drafts the same way
OFFLINE_METHOD = {
    "ngram": "ngram",
    "eagle3": "eagle3",
    "dflash": "dflash",
    "dspark_fixed": "dspark",
    "dspark_adaptive": "dspark",
    "hybrid": "hybrid",
}


def _offline(eval_doc: dict, method: str, categories: list[str]) -> tuple[float, list] | None:
    outcomes = [
        tuple(o)
        for c in categories
        for o in eval_doc.get("categories", {}).get(c, {}).get(method, {}).get("outcomes", [])
    ]
    tau = pooled_tau(outcomes)
    return None if tau is None else (round(tau, 4), tau_interval(outcomes))


def served_vs_offline(
    cells: list[dict], eval_doc: dict, workload: str, mixed_concurrency: int | None
) -> list[dict]:
    rows = []
    wanted = [(1, workload, [c for c in CATEGORIES if c == workload] or list(CATEGORIES))]
    if mixed_concurrency:
        wanted.append((mixed_concurrency, "mix", list(CATEGORIES)))
    for concurrency, cell_workload, categories in wanted:
        for x in cells:
            method = OFFLINE_METHOD.get(x["mode"])
            if (
                method is None
                or x["concurrency"] != concurrency
                or x["workload"] != cell_workload
                or x.get("tau") is None
            ):
                continue
            offline = _offline(eval_doc, method, categories)
            if offline is None:
                continue
            tau, ci = offline
            gap = ci is not None and not ci[0] <= x["tau"] <= ci[1]
            rows.append(
                {
                    "mode": x["mode"],
                    "method": method,
                    "category": cell_workload,
                    "concurrency": concurrency,
                    "served_tau": x["tau"],
                    "offline_tau": tau,
                    "offline_ci95": ci,
                    "gap": gap,
                    **(
                        {"expected": "adaptive verification"}
                        if x["mode"] == "dspark_adaptive" and gap
                        else {}
                    ),
                }
            )
    return rows
