"""Served acceptance beside offline acceptance: the tau each serving mode reached over HTTP,
next to the evaluate stage's tau for the same method (a user's "good validation, poor serving
acceptance").

Like is set beside like first. A cell serves a few prompts (its first requests, cycled), and
the category's tau varies several-fold from prompt to prompt, so the category's pooled tau is
no yardstick for it: run 6's "gaps" (ngram 1.28 served against 1.90 offline on math, EAGLE-3
1.62 against 1.97) were the served prompts, not the serving. So where the evaluation decoded
every prompt the cell served, to the same length, the row sets the served tau beside the
offline tau of exactly those prompts, with their multiplicity (`offline_same_prompts`). Greedy
serving at one stream is the offline decode step for step (tests/unit/test_serve_engine.py),
so there any difference beyond rounding is a defect; in a batch the target's numbers shift in
the last bits with the batch, which can flip a near-tie, so a `gap` is a relative difference
above SAME_PROMPTS_TOLERANCE. Otherwise (other prompts, another length) the row keeps the
category's pooled tau and its interval for context and flags nothing (`like_for_like` false).
A mode the cost model plans (`dspark_adaptive`, and every cell whose server says it planned:
`cost_model` in the cell) verifies fewer drafts than it proposes by design, so its gap is
expected and said so.

The benchmark's workload is one category (its cells at concurrency 1 are compared); the mixed
cell draws on all nine, so its offline side pools the nine categories' prompts.
"""

from __future__ import annotations

from dspark.config import CATEGORIES, DRAFT_NAMES, modes_of
from dspark.evaluate.stats import pooled_tau, tau_interval


def offline_method(mode: str) -> str | None:
    """The evaluated method that drafts the way a serving mode does: n-gram's and the hybrid's
    own, a draft's for each mode it is served as (dspark_fixed and dspark_adaptive: dspark);
    None for the target alone and the references beside ours."""
    if mode in ("ngram", "hybrid"):
        return mode
    return next((d for d in DRAFT_NAMES.names() if mode in modes_of(d)), None)


# Relative served-vs-offline difference on the same prompts that counts as a gap.
SAME_PROMPTS_TOLERANCE = 0.02


def _same_prompts(
    eval_doc: dict, method: str, categories: list[str], served: list[str], max_tokens: int | None
) -> float | None:
    """The offline pooled tau of exactly the prompts a cell served (each as often as it was),
    or None when the evaluation lacks one of them or decoded to another length."""
    outcome_of = {}
    for c in categories:
        ids = eval_doc.get("prompt_ids", {}).get(c, [])
        outcomes = eval_doc.get("categories", {}).get(c, {}).get(method, {}).get("outcomes", [])
        lengths = eval_doc.get("max_new_tokens", {})
        if max_tokens is None or lengths.get(c) != max_tokens or len(ids) != len(outcomes):
            continue
        outcome_of.update(zip(ids, (tuple(o) for o in outcomes), strict=True))
    if not served or any(i not in outcome_of for i in served):
        return None
    tau = pooled_tau([outcome_of[i] for i in served])
    return None if tau is None else round(tau, 4)


def _offline(eval_doc: dict, method: str, categories: list[str]) -> tuple[float, list] | None:
    outcomes = [
        tuple(o)
        for c in categories
        for o in eval_doc.get("categories", {}).get(c, {}).get(method, {}).get("outcomes", [])
    ]
    tau = pooled_tau(outcomes)
    return None if tau is None else (round(tau, 4), tau_interval(outcomes))


def served_vs_offline(
    cells: list[dict],
    eval_doc: dict,
    workload: str,
    mixed_concurrency: int | None,
    max_tokens: int | None = None,
) -> list[dict]:
    rows = []
    wanted = [(1, workload, [c for c in CATEGORIES if c == workload] or list(CATEGORIES))]
    if mixed_concurrency:
        wanted.append((mixed_concurrency, "mix", list(CATEGORIES)))
    for concurrency, cell_workload, categories in wanted:
        for x in cells:
            method = offline_method(x["mode"])
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
            same = _same_prompts(eval_doc, method, categories, x.get("prompt_ids", []), max_tokens)
            if same is not None:
                gap = abs(x["tau"] - same) > SAME_PROMPTS_TOLERANCE * same
            else:
                gap = False  # other prompts or lengths: context, not a verdict
            rows.append(
                {
                    "mode": x["mode"],
                    "method": method,
                    "category": cell_workload,
                    "concurrency": concurrency,
                    "served_tau": x["tau"],
                    "like_for_like": same is not None,
                    "offline_same_prompts": same,
                    "offline_tau": tau,
                    "offline_ci95": ci,
                    "gap": gap,
                    **(
                        {"expected": "the cost model verifies fewer drafts"}
                        if gap and (x["mode"] == "dspark_adaptive" or x.get("cost_model"))
                        else {}
                    ),
                }
            )
    return rows
