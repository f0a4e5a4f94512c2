"""The evaluate stage: real speculative decoding against the real target, per category and method.

Every prompt is decoded one at a time (a single stream). The target's prefill is run once per
prompt and shared by every method, since it is the same computation for all of them; each method
then decodes from a copy of it. With `lossless_check`, every greedy output is compared token for
token with transformers' greedy `generate` (static cache), whose timing is also the second
candidate for the `none` baseline: `none` reports the faster of the two engines.

A divergence where the target's top-2 logits differ by less than `TIE` (dspark.decode.reference)
is a tie (float noise between two forwards can flip it) and is reported apart; any other
divergence is a mismatch.

Every decode is recorded as it finishes (`records.py`), so a stopped evaluation resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dspark.config import CATEGORIES, LONG_CATEGORIES, MARKOV_ABLATION, EvalGoals, Params
from dspark.data.prompts import Prompt, read_prompt_file
from dspark.decode.engine import Prefill, SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import NoProposer
from dspark.decode.reference import Reference
from dspark.decode.sampling import GREEDY, Sampling
from dspark.drafts import ProposerContext, build_proposer, trained_proposer
from dspark.errors import DataError
from dspark.evaluate.records import Records, fingerprint, from_fields, trace_fields
from dspark.evaluate.report import write_plots, write_report
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


def select_prompts(prompts: list[Prompt], per_category: int | None) -> dict[str, list[Prompt]]:
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    return {c: ps[:per_category] if per_category else ps for c, ps in by_cat.items()}


def evaluate(
    params: Params, paths: EvalPaths, prompts_file: Path | None = None, progress: bool = True
) -> dict:
    cfg = params.evaluate
    source = prompts_file or paths.prompts
    selected = select_prompts(read_prompt_file(source), cfg.prompts_per_category)
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


class Evaluation:
    """Decodes each prompt with each method and tallies the outcomes. Every decode's outcome
    is recorded as it finishes (`Records`), so a stopped run resumes where it stopped."""

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
        # prompt's own text and cap are in its record's key.
        how = self.cfg.model_dump(mode="json", include={"temperature", "top_p", "ngram", "seed"})
        basis = {"evaluate": how, "target": read_manifest(paths.target)}
        self.records = Records(paths.records, fingerprint(basis, drafted, paths.code))
        self.log = EventLog(paths.events)
        self.lossless = {"mismatches": 0, "ties": 0, "checked": 0, "mismatched_ids": []}
        self._checked: set[str] = set()  # a decode read twice (sweep, then main) counts once
        self._prefilled: tuple[str, tuple] | None = None

    # --- one prompt ------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, max_new: int) -> tuple[list[int], Prefill]:
        """The target's prefill, run once per prompt and only if some decode is not recorded."""
        if self._prefilled and self._prefilled[0] == prompt.id:
            return self._prefilled[1]
        ids = self.target.chat_ids(list(prompt.messages))
        base = SpecDecoder(
            self.llama, NoProposer(), self.target.eos_token_id, self.target.max_context
        )
        try:
            pre = base.prefill([ids], max_new, taps=self.taps, draft_room=self.room)
        except ValueError as e:
            raise DataError(f"{prompt.id}: {e}") from None
        self._prefilled = (prompt.id, (ids, pre))
        return ids, pre

    def reference(self, prompt: Prompt, max_new: int) -> tuple[list[int], float] | None:
        if self.ref is None:
            return None
        key = f"{prompt.id}|{prompt.content_hash[:12]}|{max_new}|reference"
        rec = self.records.get(key)
        if rec is None:
            ids = self.target.chat_ids(list(prompt.messages))
            tokens, seconds = self.ref.generate(ids, max_new)
            rec = self.records.put(key, tokens=tokens, seconds=seconds)
        return rec["tokens"], rec["seconds"]

    def decode(self, proposer, label, prompt, max_new, want=None, sampling=GREEDY):
        mode = "greedy" if sampling.greedy else "sampled"
        key = f"{prompt.id}|{prompt.content_hash[:12]}|{max_new}|{label}|{mode}"
        rec = self.records.get(key)
        if rec is None:
            ids, pre = self.prefill(prompt, max_new)
            dec = SpecDecoder(
                self.llama, proposer, self.target.eos_token_id, self.target.max_context
            )
            traces, timing = dec.decode(pre, max_new, sampling, self.cfg.seed, fresh=True)
            verdict = None
            if sampling.greedy and want is not None:
                verdict = self.ref.compare(ids, want, traces[0].tokens)
            rec = self.records.put(key, verdict=verdict, **trace_fields(traces[0], timing))
        if rec["verdict"] is not None and key not in self._checked:
            self._checked.add(key)
            self.lossless["checked"] += 1
            if rec["verdict"] == "tie":
                self.lossless["ties"] += 1
            elif rec["verdict"] == "mismatch":
                self.lossless["mismatches"] += 1
                self.lossless["mismatched_ids"].append(f"{prompt.id}:{label}")
        return from_fields(rec)

    # --- everything ------------------------------------------------------------------------

    def all(self, selected: dict[str, list[Prompt]], progress: bool = True) -> dict:
        cfg, methods = self.cfg, self.cfg.methods
        sweep = {w: Tally() for w in self.windows}
        swept = [c for c in selected if c not in LONG_CATEGORIES] if self.ngrams else []
        sweep_bar = bar(
            total=len(swept) * len(self.ngrams),
            desc="evaluate: n-gram sweep",
            unit="decodes",
            enabled=progress and bool(swept),
        )
        # The n-gram sweep: every window on the first prompt of each of the nine categories;
        # the best window decodes everything (its sweep decodes are reused, being the same
        # records). Sampling, too, runs on the nine only.
        for cat, cat_prompts in selected.items() if self.ngrams else ():
            if cat not in LONG_CATEGORIES:
                max_new = cfg.max_new_tokens[cat]
                ref = self.reference(cat_prompts[0], max_new)
                for w, proposer in self.ngrams.items():
                    sweep[w].add(
                        *self.decode(
                            proposer, _ngram_label(w), cat_prompts[0], max_new, ref and ref[0]
                        )
                    )
                    sweep_bar.update(1)
        sweep_bar.close()
        best = max(self.windows, key=lambda w: sweep[w].tau or 0.0) if self.windows else None
        chosen = {**self.proposers, **({"ngram": self.ngrams[best]} if best else {})}
        labels = {m: _ngram_label(best) if m == "ngram" else m for m in methods}

        tallies, sampled, ablation = {}, {}, {}
        calibration, hf = Calibration(), Tally()
        sampling = Sampling(cfg.temperature, cfg.top_p)
        step = 0
        total = sum(len(ps) for ps in selected.values())
        prompts_bar = bar(total=total, desc="evaluate", unit="prompts", enabled=progress)
        for cat, cat_prompts in selected.items():
            max_new = cfg.max_new_tokens[cat]
            tallies[cat] = {m: Tally() for m in methods}
            sampled[cat] = {m: Tally() for m in methods}
            ablation[cat] = {v: Tally() for v in self.ablation}
            for i, prompt in enumerate(cat_prompts):
                ref = self.reference(prompt, max_new)
                want = None
                if ref is not None:
                    want = ref[0]
                    hf.tokens += len(ref[0])
                    hf.prefill_s += ref[1]
                for m in methods:
                    trace, timing = self.decode(chosen[m], labels[m], prompt, max_new, want)
                    tallies[cat][m].add(trace, timing)
                    if m == "dspark":
                        calibration.add(trace)
                for variant, proposer in self.ablation.items():
                    ablation[cat][variant].add(
                        *self.decode(proposer, variant, prompt, max_new, want)
                    )
                if i < cfg.sampling_prompts_per_category and cat not in LONG_CATEGORIES:
                    for m in methods:
                        sampled[cat][m].add(
                            *self.decode(chosen[m], m, prompt, max_new, sampling=sampling)
                        )
                step += 1
                # "<method>/..." keys land in the method's child run (tasks/stage.py).
                taus = {f"{m}/tau_{cat}": t.tau for m, t in tallies[cat].items() if t.steps}
                self.log.log(step, **taus)
                prompts_bar.set_postfix_str(cat, refresh=False)
                prompts_bar.update(1)
        prompts_bar.close()

        result = assemble(self.params, tallies, sampled, ablation, calibration, sweep, best, hf)
        result["lossless_mismatches"] = self.lossless["mismatches"]
        result["lossless_ties"] = self.lossless["ties"]
        result["lossless"] = self.lossless
        result["prompts"] = {c: len(ps) for c, ps in selected.items()}
        result["resumed_decodes"] = self.records.replayed
        if cfg.lm_eval.limit:
            if progress:
                say(f"evaluate: lm-eval, {cfg.lm_eval.limit} problems per method")
            result["quality"] = quality(self.params, self.target, self.llama, chosen, self.context)
        return result


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
    categories = {c: {m: t.summary() for m, t in ts.items()} for c, ts in tallies.items()}
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
    result = {
        "categories": categories,
        "mean": mean,
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
    result["goals"] = goals(mean, cfg.goals)
    return result


def _mean(values) -> float | None:
    """The mean of the values that exist (a category with no verify step has no tau)."""
    got = [v for v in values if v is not None]
    return round(sum(got) / len(got), 4) if got else None


def goals(mean: dict, targets: EvalGoals) -> dict:
    """Issue 5's goals (evaluate.goals) on the nine-category mean tau."""
    out = {}
    d = mean.get("dspark")
    for name, other, goal in (
        ("dspark_over_eagle3", mean.get("eagle3"), targets.dspark_over_eagle3),
        ("dspark_over_ngram", mean.get("ngram"), targets.dspark_over_ngram),
    ):
        if d and other:
            out[name] = {"ratio": round(d / other, 3), "goal": goal, "met": d / other >= goal}
    return out
