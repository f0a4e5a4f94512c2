"""The evaluate stage: real speculative decoding against the real target, per category and method.

The prompts of a category are decoded `evaluate.batch_size` at a time: acceptance does not
depend on the batch (each row drafts and verifies on its own), and single-stream speed is the
benchmark's to measure. The target's prefill of a batch is run once and shared by every method,
since it is the same computation for all of them; each method then decodes from a copy of it.
With `lossless_check`, every greedy output is compared token for token with transformers' greedy
`generate` (static cache, batched the same way), whose timing is also the second candidate for
the `none` baseline: `none` reports the faster of the two engines.

Each category's tau comes with a 95% bootstrap interval over its prompts, and each pair of
methods with the ratio of their mean tau and its paired interval (`dspark.evaluate.stats`).

A divergence where the target's top-2 logits differ by less than `TIE` (dspark.decode.reference)
is a tie (float noise between two forwards can flip it) and is reported apart; any other
divergence is a mismatch.

Every decode is recorded as it finishes (`records.py`), so a stopped evaluation resumes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

from dspark.config import CATEGORIES, LONG_CATEGORIES, MARKOV_ABLATION, EvalGoals, Params
from dspark.data.prompts import Prompt, read_prompt_file
from dspark.decode.engine import Prefill, RowTrace, SpecDecoder, Timing
from dspark.decode.llama import Llama
from dspark.decode.proposers import NoProposer
from dspark.decode.reference import Reference
from dspark.decode.sampling import GREEDY, Sampling
from dspark.drafts import DRAFT_KINDS, ProposerContext, build_proposer, trained_proposer
from dspark.errors import DataError
from dspark.evaluate.records import Records, fingerprint, from_fields, trace_fields
from dspark.evaluate.report import write_plots, write_report
from dspark.evaluate.stats import mean_tau_interval, paired_ratio, verdict
from dspark.evaluate.summary import Calibration, Tally
from dspark.metrics import EventLog
from dspark.models.target import Target, load_target_for, read_manifest, set_threads
from dspark.progress import bar, say


@dataclass(frozen=True)
class EvalPaths:
    target: Path
    drafts: Path
    prompts: Path
    plots: Path  # folder for eval_*.csv / eval_*.png
    report: Path
    records: Path  # the stage's checkpoint: every decode's outcome (persists across runs)
    events: Path | None = None
    code: tuple[str, ...] = ()  # the stage's DVC deps: the library code its records depend on


def select_prompts(
    prompts: list[Prompt],
    per_category: int | None,
    per_long_case: int | None = None,
    seed: int = 0,
) -> dict[str, list[Prompt]]:
    """N prompts of each category, drawn with `seed` (the same N and seed draw the same ones),
    in the eval set's order; all of a category with fewer, or with no N."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out = {}
    for cat, ps in by_cat.items():
        n = per_long_case if cat in LONG_CATEGORIES else per_category
        if n is None or n >= len(ps):
            out[cat] = ps
        else:
            drawn = random.Random(f"{seed}:{cat}").sample(range(len(ps)), n)
            out[cat] = [ps[i] for i in sorted(drawn)]
    return out


def evaluate(
    params: Params, paths: EvalPaths, prompts_file: Path | None = None, progress: bool = True
) -> dict:
    cfg = params.evaluate
    source = prompts_file or paths.prompts
    selected = select_prompts(
        read_prompt_file(source), cfg.prompts_per_category, cfg.long_prompts_per_case, cfg.seed
    )
    for cat in selected:
        if cat not in cfg.max_new_tokens:
            raise DataError(f"evaluate.max_new_tokens: no cap for category {cat!r}")
    set_threads(params.provision.threads)
    target = load_target_for(params.target, paths.target)
    result = Evaluation(params, target, paths).all(selected, progress=progress)
    result["prompt_source"] = str(source)
    write_plots(result, paths.plots)
    write_report({**result, "profile": params.profile}, paths.report)
    if not result.get("quality", {}).get("identical_scores", True):
        raise DataError(f"lm-eval scores differ between methods: {result['quality']}")
    if result["lossless_mismatches"]:
        raise DataError(
            f"lossless check failed: {result['lossless_mismatches']} greedy output(s) differ "
            f"from the target's ({', '.join(result['lossless']['mismatched_ids'][:5])})"
        )
    return result


def batches(prompts: list[Prompt], size: int, cap: dict[str, int]) -> list[list[Prompt]]:
    """`prompts` in batches of at most `size` that share a generation cap (one decode runs to
    one cap), in the given order within each group. A long-context prompt goes alone: a padded
    batch's prefill attends over every row's full width (8 rows of 8K tokens took transformers
    over 8 minutes and 7 GB here), while one row alone takes the causal fast path."""
    groups: dict[tuple[bool, int], list[Prompt]] = {}
    for p in prompts:
        groups.setdefault((p.category in LONG_CATEGORIES, cap[p.category]), []).append(p)
    return [
        g[i : i + step]
        for (long, _), g in groups.items()
        for step in [1 if long else size]
        for i in range(0, len(g), step)
    ]


class Evaluation:
    """Decodes the prompts of each category with each method, `evaluate.batch_size` prompts at
    a time (one prefill, shared by the methods; each method decodes from a copy of it), and
    tallies the outcomes per prompt. Every decode's outcome is recorded as its batch finishes
    (`Records`), so a stopped run resumes where it stopped."""

    def __init__(self, params: Params, target: Target, paths: EvalPaths):
        self.params, self.cfg, self.target = params, params.evaluate, target
        self.llama = Llama.from_hf(target.model)
        methods = self.cfg.methods
        self.context = ProposerContext.for_evaluate(params, target, paths.drafts)
        # n-gram: one per swept window, below.
        self.proposers = {m: build_proposer(m, self.context) for m in methods if m != "ngram"}
        self.ablation = {}  # the Markov variants the train stage trained (train.markov_ablation)
        if "dspark" in methods:
            for name in MARKOV_ABLATION:
                if (paths.drafts / name / "config.json").is_file():
                    self.ablation[name.removeprefix("dspark_")] = trained_proposer(
                        self.context, name
                    )
        self.windows = [tuple(w) for w in self.cfg.ngram.windows] if "ngram" in methods else []
        self.ngrams = {
            w: build_proposer("ngram", replace(self.context, ngram_window=w)) for w in self.windows
        }
        every = [*self.proposers.values(), *self.ablation.values(), *self.ngrams.values()]
        self.taps = tuple(sorted({t for p in every for t in p.taps}))
        self.room = max(p.k for p in every)
        self.ref = Reference(target) if self.cfg.lossless_check else None
        drafted = sorted(paths.drafts.glob("*/*")) if paths.drafts.is_dir() else []
        # What decides a decode's outcome; which prompts and methods run is a selection, and a
        # prompt's own text and cap are in its record's key. The batch is neither: greedy
        # tokens and tau are the same at any batch (a test holds it to that).
        how = self.cfg.model_dump(mode="json", include={"temperature", "top_p", "ngram", "seed"})
        basis = {"evaluate": how, "target": read_manifest(paths.target)}
        self.records = Records(paths.records, fingerprint(basis, drafted, paths.code))
        self.log = EventLog(paths.events)
        self.lossless = {"mismatches": 0, "ties": 0, "checked": 0, "mismatched_ids": []}
        self._checked: set[str] = set()  # a decode read twice (sweep, then main) counts once
        self._prefilled: tuple[tuple[str, ...], Prefill] | None = None

    # --- a batch of prompts ----------------------------------------------------------------

    def cap(self, prompt: Prompt) -> int:
        return self.cfg.max_new_tokens[prompt.category]

    def key(self, prompt: Prompt, label: str) -> str:
        return f"{prompt.id}|{prompt.content_hash[:12]}|{self.cap(prompt)}|{label}"

    def prefill(self, prompts: list[Prompt]) -> Prefill:
        """The target's prefill of a batch (one cap), run once for every method decoding it."""
        ids = tuple(p.id for p in prompts)
        if self._prefilled and self._prefilled[0] == ids:
            return self._prefilled[1]
        self._prefilled = None  # free the last one first: long-context caches are large
        base = SpecDecoder(
            self.llama, NoProposer(), self.target.eos_token_id, self.target.max_context
        )
        chats = [self.target.chat_ids(list(p.messages)) for p in prompts]
        try:
            pre = base.prefill(chats, self.cap(prompts[0]), taps=self.taps, draft_room=self.room)
        except ValueError as e:
            raise DataError(f"{', '.join(ids)}: {e}") from None
        self._prefilled = (ids, pre)
        return pre

    def references(self, prompts: list[Prompt], done=None) -> dict[str, tuple[list[int], float]]:
        """prompt id -> transformers' greedy continuation (and its share of the seconds),
        generated a batch at a time for those not yet recorded; `done(n)` as batches end."""
        todo = [p for p in prompts if self.records.get(self.key(p, "reference")) is None]
        if done:
            done(len(prompts) - len(todo))
        for batch in batches(todo, self.cfg.batch_size, self.cfg.max_new_tokens):
            chats = [self.target.chat_ids(list(p.messages)) for p in batch]
            outs, seconds = self.ref.generate_batch(chats, self.cap(batch[0]))
            share = _shares(seconds, [len(o) for o in outs])
            for p, tokens, sec in zip(batch, outs, share, strict=True):
                self.records.put(self.key(p, "reference"), tokens=tokens, seconds=sec)
            if done:
                done(len(batch))
        recs = {p.id: self.records.get(self.key(p, "reference")) for p in prompts}
        return {i: (r["tokens"], r["seconds"]) for i, r in recs.items()}

    def decode(
        self,
        proposer,
        label: str,
        prompts: list[Prompt],
        wants: dict[str, list[int]] | None = None,
        sampling: Sampling = GREEDY,
    ) -> list[tuple[RowTrace, Timing]]:
        """Each prompt of a batch (one cap) decoded by `proposer`: the rows not yet recorded,
        together (from the batch's shared prefill when that is all of them); greedy outputs
        checked against `wants` (transformers', by prompt id)."""
        mode = "greedy" if sampling.greedy else "sampled"
        keys = [f"{self.key(p, label)}|{mode}" for p in prompts]
        todo = [(p, k) for p, k in zip(prompts, keys, strict=True) if self.records.get(k) is None]
        if todo:
            rows = [p for p, _ in todo]
            pre = self.prefill(rows)
            dec = SpecDecoder(
                self.llama, proposer, self.target.eos_token_id, self.target.max_context
            )
            traces, timing = dec.decode(pre, self.cap(rows[0]), sampling, self.cfg.seed, fresh=True)
            shares = _timing_shares(timing, [len(t.tokens) for t in traces])
            for (p, k), trace, t in zip(todo, traces, shares, strict=True):
                verdict = None
                if sampling.greedy and wants is not None:
                    ids = self.target.chat_ids(list(p.messages))
                    verdict = self.ref.compare(ids, wants[p.id], trace.tokens)
                self.records.put(k, verdict=verdict, **trace_fields(trace, t))
        out = []
        for p, k in zip(prompts, keys, strict=True):
            rec = self.records.get(k)
            self._count_lossless(rec, k, f"{p.id}:{label}")
            out.append(from_fields(rec))
        return out

    def _count_lossless(self, rec: dict, key: str, name: str) -> None:
        if rec["verdict"] is None or key in self._checked:
            return
        self._checked.add(key)
        self.lossless["checked"] += 1
        if rec["verdict"] == "tie":
            self.lossless["ties"] += 1
        elif rec["verdict"] == "mismatch":
            self.lossless["mismatches"] += 1
            self.lossless["mismatched_ids"].append(name)

    # --- everything ------------------------------------------------------------------------

    def all(self, selected: dict[str, list[Prompt]], progress: bool = True) -> dict:
        """Batches run across categories (those that share a cap), each prefilled once and
        decoded by every method in turn, as the old one-prompt loop shared each prefill."""
        cfg, methods = self.cfg, self.cfg.methods
        size, caps = cfg.batch_size, cfg.max_new_tokens
        nine = [c for c in selected if c not in LONG_CATEGORIES]
        every = [p for ps in selected.values() for p in ps]
        refs, wants = {}, None
        if self.ref is not None:
            ref_bar = bar(
                total=len(every), desc="evaluate: reference", unit="prompts", enabled=progress
            )
            refs = self.references(every, done=ref_bar.update)
            ref_bar.close()
            wants = {i: tokens for i, (tokens, _) in refs.items()}

        # The n-gram sweep: every window on the first prompt of each of the nine categories;
        # the best window decodes everything (its sweep decodes are reused, being the same
        # records). Sampling, too, runs on the nine only.
        sweep = {w: Tally() for w in self.windows}
        firsts = [selected[c][0] for c in nine]
        if self.ngrams and firsts:
            sweep_bar = bar(
                total=len(firsts) * len(self.ngrams),
                desc="evaluate: n-gram sweep",
                unit="decodes",
                enabled=progress,
            )
            for batch in batches(firsts, size, caps):
                for w, proposer in self.ngrams.items():
                    for got in self.decode(proposer, _ngram_label(w), batch, wants):
                        sweep[w].add(*got)
                    sweep_bar.update(len(batch))
            sweep_bar.close()
        best = max(self.windows, key=lambda w: sweep[w].tau or 0.0) if self.windows else None
        chosen = {**self.proposers, **({"ngram": self.ngrams[best]} if best else {})}
        labels = {m: _ngram_label(best) if m == "ngram" else m for m in methods}
        variants = {f"dspark_{v}": (p, v) for v, p in self.ablation.items()}

        tallies = {c: {m: Tally() for m in methods} for c in selected}
        ablation = {c: {v: Tally() for v in self.ablation} for c in selected}
        bars = {
            m: bar(total=len(every), desc=f"evaluate: {m}", unit="prompts", enabled=progress)
            for m in [*methods, *variants]
        }
        calibration = Calibration()
        for step, batch in enumerate(batches(every, size, caps), start=1):
            for m in methods:
                for p, (trace, timing) in zip(
                    batch, self.decode(chosen[m], labels[m], batch, wants), strict=True
                ):
                    tallies[p.category][m].add(trace, timing)
                    if m == "dspark":
                        calibration.add(trace)
                bars[m].update(len(batch))
            for name, (proposer, v) in variants.items():
                for p, got in zip(batch, self.decode(proposer, v, batch, wants), strict=True):
                    ablation[p.category][v].add(*got)
                bars[name].update(len(batch))
            # "<method>/..." keys land in the method's child run (tasks/stage.py).
            touched = {p.category for p in batch}
            taus = {f"{m}/tau_{c}": tallies[c][m].tau for c in touched for m in methods}
            self.log.log(step, **{k: v for k, v in taus.items() if v is not None})
        for b in bars.values():
            b.close()

        sampled = {c: {m: Tally() for m in methods} for c in selected}
        few = [p for c in nine for p in selected[c][: cfg.sampling_prompts_per_category]]
        if few:
            sampling = Sampling(cfg.temperature, cfg.top_p)
            sampled_bar = bar(
                total=len(few) * len(methods),
                desc="evaluate: sampled",
                unit="decodes",
                enabled=progress,
            )
            for batch in batches(few, size, caps):
                for m in methods:
                    got = self.decode(chosen[m], m, batch, sampling=sampling)
                    for p, outcome in zip(batch, got, strict=True):
                        sampled[p.category][m].add(*outcome)
                    sampled_bar.update(len(batch))
            sampled_bar.close()

        hf = Tally()  # transformers' batched greedy generate, the second `none` candidate
        hf.tokens = sum(len(t) for t, _ in refs.values())
        hf.prefill_s = sum(sec for _, sec in refs.values())
        result = assemble(self.params, tallies, sampled, ablation, calibration, sweep, best, hf)
        result["lossless_mismatches"] = self.lossless["mismatches"]
        result["lossless_ties"] = self.lossless["ties"]
        result["lossless"] = self.lossless
        result["prompts"] = {c: len(ps) for c, ps in selected.items()}
        result["prompt_ids"] = {c: [p.id for p in ps] for c, ps in selected.items()}
        result["batch_size"] = size
        result["resumed_decodes"] = self.records.replayed
        if cfg.lm_eval.limit:
            if progress:
                say(f"evaluate: lm-eval, {cfg.lm_eval.limit} problems per method")
            result["quality"] = quality(self.params, self.target, self.llama, chosen, self.context)
        return result


def _shares(total: float, weights: list[int]) -> list[float]:
    """`total` split in proportion to `weights` (evenly where they are all 0)."""
    whole = sum(weights)
    if not whole:
        return [total / len(weights)] * len(weights)
    return [total * w / whole for w in weights]


def _timing_shares(timing: Timing, tokens: list[int]) -> list[Timing]:
    """A batch's timing split over its rows by the tokens each generated, so that the rows'
    sums are the batch's: tok/s over a category is then the batched throughput."""
    parts = [_shares(getattr(timing, f), tokens) for f in ("prefill_s", "draft_s", "verify_s")]
    return [Timing(*row) for row in zip(*parts, strict=True)]


def _ngram_label(window: tuple[int, int]) -> str:
    return f"ngram_{window[0]}_{window[1]}"


def quality(params: Params, target, llama, proposers: dict, context: ProposerContext) -> dict:
    # lm-eval is heavy to import: only when scoring.
    from dspark.evaluate.quality import SpecLM, score

    cfg = params.evaluate.lm_eval
    models = {
        m: SpecLM(
            target,
            llama=llama,
            method=m,
            proposer=proposers.get(m) or build_proposer(m, context),
        )
        for m in cfg.methods
    }
    return score(models, cfg.limit, cfg.max_gen_toks)


def assemble(params, tallies, sampled, ablation_tallies, calibration, sweep, best_window, hf):
    cfg = params.evaluate
    # Each prompt's (emitted, steps) stays beside the summary: the benchmark's served tau is
    # set against the offline one with these (dspark.serve.offline).
    categories = {
        c: {m: {**t.summary(), "outcomes": t.outcomes} for m, t in ts.items()}
        for c, ts in tallies.items()
    }
    methods = list(cfg.methods)
    nine = [c for c in CATEGORIES if c in tallies]
    mean = {m: _mean(categories[c][m]["tau"] for c in nine) for m in methods}
    overall = {}
    for m in methods:
        total = Tally()
        for c in tallies:
            total.merge(tallies[c][m])
        overall[m] = total.summary()
    if "none" in overall and hf.tokens:
        # `none` is the faster of our engine at k=0 and transformers' static-cache generate.
        hf_tok_s = round(hf.tokens / hf.prefill_s, 2)
        overall["none"]["tok_s_ours"] = overall["none"]["tok_s"]
        overall["none"]["tok_s_transformers"] = hf_tok_s
        overall["none"]["tok_s"] = max(overall["none"]["tok_s"] or 0.0, hf_tok_s)
    base = overall.get("none", {}).get("tok_s")
    for m in methods:
        if base and overall[m]["tok_s"]:
            overall[m]["speedup"] = round(overall[m]["tok_s"] / base, 3)
    nine_outcomes = {m: {c: tallies[c][m].outcomes for c in nine} for m in methods}
    result = {
        "categories": categories,
        "mean": mean,
        "mean_ci95": {m: mean_tau_interval(nine_outcomes[m]) for m in methods},
        "pairs": pairs(nine_outcomes),
        "overall": overall,
        "ngram_sweep": {f"{lo}-{hi}": t.summary()["tau"] for (lo, hi), t in sweep.items()},
        "ngram_window": list(best_window) if best_window else None,
        "calibration": calibration.summary(),
    }
    if any(t.steps for ts in sampled.values() for t in ts.values()):
        s_cats = {
            c: {m: t.summary() for m, t in ts.items() if t.steps} for c, ts in sampled.items()
        }
        s_mean = {m: _mean(s_cats[c][m]["tau"] for c in nine if m in s_cats[c]) for m in methods}
        result["sampling"] = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "categories": s_cats,
            "mean": s_mean,
        }
    if any(ablation_tallies.values()):
        abl = {"vanilla": {"mean_tau": mean.get("dspark")}}
        for v in next(iter(ablation_tallies.values())):
            taus = {c: ablation_tallies[c][v].summary()["tau"] for c in ablation_tallies}
            abl[v] = {"mean_tau": _mean(taus[c] for c in nine), "categories": taus}
        result["markov_ablation"] = abl
    result["goals"] = goals(result["pairs"], cfg.goals)
    return result


def pairs(outcomes: dict[str, dict[str, list]]) -> dict[str, dict]:
    """Mean tau over the nine, method over method on the same prompts, with paired bootstrap
    intervals: every pair of trained drafts, and each draft over n-gram."""
    drafts = [m for m in outcomes if m in DRAFT_KINDS.names()]
    wanted = list(combinations(drafts, 2))
    wanted += [(d, "ngram") for d in drafts if "ngram" in outcomes]
    out = {}
    for a, b in wanted:
        got = paired_ratio(outcomes[a], outcomes[b])
        if got is not None:
            out[f"{a}/{b}"] = got
    return out


def _mean(values) -> float | None:
    """The mean of the values that exist (a category with no verify step has no tau)."""
    got = [v for v in values if v is not None]
    return round(sum(got) / len(got), 4) if got else None


def goals(pairs: dict[str, dict], targets: EvalGoals) -> dict:
    """Issue 5's goals (evaluate.goals) on the nine-category mean tau, judged on the paired
    interval: met only when all of it clears the goal ('straddles' says the prompts cannot
    tell yet)."""
    out = {}
    for name, pair, goal in (
        ("dspark_over_eagle3", "dspark/eagle3", targets.dspark_over_eagle3),
        ("dspark_over_ngram", "dspark/ngram", targets.dspark_over_ngram),
    ):
        if pair in pairs:
            p = pairs[pair]
            v = verdict(p["ci95"], goal)
            out[name] = {**p, "goal": goal, "verdict": v, "met": v == "met"}
    return out
