"""The evaluate stage: speculative decoding against the real target, per category and method.

Greedy acceptance is measured by replay (`dspark.decode.replay`): each batch of prompts is
decoded greedily once by the target on our decoder, recording its hidden states and choices at
every position (the prompts' paths), and every method (each n-gram window and Markov variant
too) then decodes on the unchanged decoder with that recording standing in for the target.
Greedy verification accepts exactly the drafts that match the target's greedy path, so tau is
the one a live decode measures, without a target pass per method and step (most of the stage's
cost at low acceptance). Every path is checked against transformers, teacher-forced: one
forward per batch gives transformers' greedy choice at every step of it.

A few short prompts (`evaluate.live_prompts`, spread over the nine) are also decoded live by
every method, batched: greedy, each output compared token for token with transformers' and each
trace step for step with its replay; and sampled (temperature, top-p), which no recording can
stand in for. The live decodes give the speed columns; single-stream speed is the benchmark's.

Each category's tau comes with a 95% bootstrap interval over its prompts, and each pair of
methods with the ratio of their mean tau and its paired interval (`dspark.evaluate.stats`).

A divergence where the target's top-2 logits differ by less than `TIE` (dspark.decode.reference)
is a tie (float noise between two forwards can flip it) and is reported apart; any other
divergence is a mismatch.

Every decode is recorded as it finishes (`records.py`), so a stopped evaluation resumes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from itertools import combinations
from pathlib import Path

from dspark.config import CATEGORIES, LONG_CATEGORIES, MARKOV_ABLATION, EvalGoals, Params
from dspark.data.prompts import Prompt, read_prompt_file
from dspark.decode.decoder import Prefill, RowTrace, SpecDecoder, Timing
from dspark.decode.llama import Llama
from dspark.decode.proposers import NoProposer
from dspark.decode.reference import TIE, Reference
from dspark.decode.replay import Playback, Recording, decode_recorded
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


def evaluate_stage(
    params: Params, paths: EvalPaths, prompts_file: Path | None = None, progress: bool = True
) -> dict:
    cfg = params.evaluate
    source = prompts_file or paths.prompts
    selected = select_prompts(
        read_prompt_file(source), cfg.prompts_per_category, cfg.long_prompts_per_case, cfg.seed
    )
    if cfg.categories is not None:
        missing = [c for c in cfg.categories if c not in selected]
        if missing:
            raise DataError(f"evaluate.categories: {source} has no {missing[0]!r} prompts")
        selected = {c: selected[c] for c in cfg.categories}
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


def batches(
    prompts: list[Prompt],
    size: int,
    cap: dict[str, int],
    length: dict[str, int] | None = None,
) -> list[list[Prompt]]:
    """`prompts` in batches of at most `size` that share a generation cap (one decode runs to
    one cap), shortest first within each group by `length` (tokens, by prompt id), else in the
    given order: every row of a batch is padded to its longest (32 rows beside one 1,900-token
    RAG prompt kept transformers' generate busy for over 5 minutes here). A long-context prompt
    goes alone: a padded batch's prefill attends over every row's full width (8 rows of 8K
    tokens took transformers over 8 minutes and 7 GB here), while one row alone takes the
    causal fast path."""
    groups: dict[tuple[bool, int], list[Prompt]] = {}
    for p in prompts:
        groups.setdefault((p.category in LONG_CATEGORIES, cap[p.category]), []).append(p)
    if length is not None:
        groups = {k: sorted(g, key=lambda p: length[p.id]) for k, g in groups.items()}
    return [
        g[i : i + step]
        for (long, _), g in groups.items()
        for step in [1 if long else size]
        for i in range(0, len(g), step)
    ]


class Evaluation:
    """Records the target's path of every prompt and replays every method on it, decodes a few
    prompts live with every method, and tallies the outcomes per prompt. Every decode's outcome
    is recorded as its batch finishes (`Records`), so a stopped run resumes where it stopped."""

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
        self.ref = Reference(target)
        drafted = sorted(paths.drafts.glob("*/*")) if paths.drafts.is_dir() else []
        # What decides a decode's outcome; which prompts and methods run is a selection, and a
        # prompt's own text and cap are in its record's key. The batch is neither: greedy
        # tokens and tau are the same at any batch (a test holds it to that).
        how = self.cfg.model_dump(
            mode="json", include={"temperature", "top_p", "ngram", "hybrid", "seed"}
        )
        basis = {"evaluate": how, "target": read_manifest(paths.target)}
        self.records = Records(paths.records, fingerprint(basis, drafted, paths.code))
        self.log = EventLog(paths.events)
        self.lossless = {
            "mismatches": 0,
            "ties": 0,
            "checked": 0,
            "mismatched_ids": [],
            "positions": 0,
        }
        self._checked: set[str] = set()  # an outcome read twice counts once
        self._recorded: tuple[tuple[str, ...], Recording] | None = None
        self._prefilled: tuple[tuple[str, ...], Prefill] | None = None
        self._length: dict[str, int] = {}  # prompt id -> templated tokens
        # The target's own work, split for sizing the stage: our decoder's prefill and decode
        # of the paths, and transformers' check of them; short prompts apart from long ones.
        self.paths_s = {
            f"{part}_{kind}": 0.0
            for part in ("prefill", "decode", "check")
            for kind in ("short", "long")
        }

    # --- a batch of prompts ----------------------------------------------------------------

    def cap(self, prompt: Prompt) -> int:
        return self.cfg.max_new_tokens[prompt.category]

    def key(self, prompt: Prompt, label: str) -> str:
        return f"{prompt.id}|{prompt.content_hash[:12]}|{self.cap(prompt)}|{label}"

    def chats(self, prompts: list[Prompt]) -> list[list[int]]:
        return [self.target.chat_ids(list(p.messages)) for p in prompts]

    def batches(self, prompts: list[Prompt]) -> list[list[Prompt]]:
        """`batches` of these prompts at evaluate.batch_size, by their templated length."""
        for p in prompts:
            if p.id not in self._length:
                self._length[p.id] = len(self.target.chat_ids(list(p.messages)))
        return batches(prompts, self.cfg.batch_size, self.cfg.max_new_tokens, self._length)

    def paths(self, prompts: list[Prompt]) -> dict[str, list[int]]:
        """prompt id -> the target's greedy continuation (its path) for a batch, from the
        records or from recording the batch."""
        if any(self.records.get(self.key(p, "path")) is None for p in prompts):
            self.recording(prompts)
        return {p.id: self.records.get(self.key(p, "path"))["tokens"] for p in prompts}

    def recording(self, prompts: list[Prompt]) -> Recording:
        """The target's greedy decode of a batch, recorded (kept for every method replaying
        it); each path is checked against transformers, teacher-forced, and recorded with
        where it differs."""
        ids = tuple(p.id for p in prompts)
        if self._recorded and self._recorded[0] == ids:
            return self._recorded[1]
        self._recorded = None  # free the last one first: long-context recordings are large
        chats = self.chats(prompts)
        kind = "long" if prompts[0].category in LONG_CATEGORIES else "short"
        t0 = time.perf_counter()
        try:
            traces, timing, rec = decode_recorded(
                self.llama,
                self.target.eos_token_id,
                self.target.max_context,
                chats,
                self.cap(prompts[0]),
                self.taps,
                reach=max(self.room - 1, 0),  # a draft of k verifies k - 1 past the last token
            )
        except ValueError as e:
            raise DataError(f"{', '.join(ids)}: {e}") from None
        recorded = time.perf_counter()
        self.paths_s[f"prefill_{kind}"] += timing.prefill_s
        self.paths_s[f"decode_{kind}"] += recorded - t0 - timing.prefill_s
        paths = [t.tokens for t in traces]
        differ = self.ref.check_batch(chats, paths)
        self.paths_s[f"check_{kind}"] += time.perf_counter() - recorded
        shares = _shares(timing.total_s, [len(q) for q in paths])
        for p, q, d, sec in zip(prompts, paths, differ, shares, strict=True):
            self.records.put(self.key(p, "path"), tokens=q, differ=d, seconds=sec)
        self._recorded = (ids, rec)
        return rec

    def _count_path(self, prompt: Prompt) -> None:
        """A prompt's path against transformers, once per prompt, into the lossless tally."""
        key = self.key(prompt, "path")
        if key in self._checked:
            return
        self._checked.add(key)
        rec = self.records.get(key)
        self.lossless["positions"] += len(rec["tokens"])
        for at, margin in rec["differ"]:
            if margin < TIE:
                self.lossless["ties"] += 1
            else:
                self.lossless["mismatches"] += 1
                self.lossless["mismatched_ids"].append(f"{prompt.id}:path@{at}")

    def replay(self, proposer, label: str, prompts: list[Prompt]) -> list[tuple[RowTrace, Timing]]:
        """Each prompt of a batch (one cap) decoded greedily by `proposer` on the batch's
        recording; the rows not yet recorded, together."""
        keys = [f"{self.key(p, label)}|replay" for p in prompts]
        todo = [i for i, k in enumerate(keys) if self.records.get(k) is None]
        wants = self.paths(prompts)
        if todo:
            rec = self.recording(prompts).rows(todo)
            rows = [prompts[i] for i in todo]
            dec = SpecDecoder(
                Playback(rec, self.target.vocab_size),
                proposer,
                self.target.eos_token_id,
                self.target.max_context,
            )
            traces, timing = dec.generate(self.chats(rows), self.cap(rows[0]), GREEDY)
            shares = _timing_shares(timing, [len(t.tokens) for t in traces])
            for i, trace, t in zip(todo, traces, shares, strict=True):
                if trace.tokens != wants[prompts[i].id]:  # the path is given: a bug, not data
                    raise RuntimeError(f"{prompts[i].id}: {label}'s replay left its recording")
                self.records.put(keys[i], **trace_fields(trace, t))
        for p in prompts:
            self._count_path(p)
        return [from_fields(self.records.get(k)) for k in keys]

    def prefill(self, prompts: list[Prompt]) -> Prefill:
        """The target's prefill of a live batch (one cap), run once for every method."""
        ids = tuple(p.id for p in prompts)
        if self._prefilled and self._prefilled[0] == ids:
            return self._prefilled[1]
        self._prefilled = None
        base = SpecDecoder(
            self.llama, NoProposer(), self.target.eos_token_id, self.target.max_context
        )
        try:
            pre = base.prefill(
                self.chats(prompts), self.cap(prompts[0]), taps=self.taps, draft_room=self.room
            )
        except ValueError as e:
            raise DataError(f"{', '.join(ids)}: {e}") from None
        self._prefilled = (ids, pre)
        return pre

    def decode(
        self,
        proposer,
        label: str,
        prompts: list[Prompt],
        wants: dict[str, list[int]] | None = None,
        sampling: Sampling = GREEDY,
    ) -> list[tuple[RowTrace, Timing]]:
        """Each prompt of a batch (one cap) decoded live by `proposer`: the rows not yet
        recorded, together (from the batch's shared prefill when that is all of them); greedy
        outputs checked against `wants` (transformers', by prompt id)."""
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

    def live_prompts(self, selected: dict[str, list[Prompt]]) -> list[Prompt]:
        """`evaluate.live_prompts` of the nine categories' selection, one per category, round
        after round: each category's shortest first, the categories in the order of their
        shortest prompt. A live decode is the stage's dearest part and its prefill grows with the
        prompt, so a few live prompts do not land on a RAG prompt's 1,500-token context."""
        nine = [c for c in selected if c not in LONG_CATEGORIES and selected[c]]
        by_length = {c: sorted(selected[c], key=lambda p: (len(p.text), p.id)) for c in nine}
        nine.sort(key=lambda c: (len(by_length[c][0].text), c))
        rounds = max((len(by_length[c]) for c in nine), default=0)
        order = [by_length[c][r] for r in range(rounds) for c in nine if r < len(by_length[c])]
        return order[: self.cfg.live_prompts]

    # --- everything ------------------------------------------------------------------------

    def all(self, selected: dict[str, list[Prompt]], progress: bool = True) -> dict:
        cfg, methods = self.cfg, self.cfg.methods
        # Where the stage's time goes (seconds per phase), for sizing it to its budget.
        phases = {"target_paths": 0.0, "replay": 0.0, "live": 0.0, "lm_eval": 0.0}
        t0 = time.perf_counter()
        replayed = self.replay_every_prompt(selected, phases, progress)
        phases["replay"] = time.perf_counter() - t0 - phases["target_paths"]
        best = self.best_window(replayed.per, [c for c in selected if c not in LONG_CATEGORIES])
        chosen = {**self.proposers, **({"ngram": self.ngrams[best]} if best else {})}
        labels = {m: _ngram_label(best) if m == "ngram" else m for m in methods}
        tallies = {c: {m: replayed.per[labels[m]][c] for m in methods} for c in selected}
        ablation = {c: {v: replayed.per[f"dspark_{v}"][c] for v in self.ablation} for c in selected}
        # Every method's final tau per category, n-gram's (its best window's) included.
        taus = {f"{m}/tau_{c}": tallies[c][m].tau for c in selected for m in methods}
        self.log.log(replayed.steps + 1, **{k: v for k, v in taus.items() if v is not None})

        t0 = time.perf_counter()
        live = self.decode_live(selected, chosen, labels, replayed.wants, progress)
        phases["live"] = time.perf_counter() - t0

        sweep = {w: replayed.per[_ngram_label(w)] for w in self.windows}
        result = assemble(
            self.params, tallies, live.sampled, ablation, replayed.calibration, sweep, best
        )
        result["overall"] = overall(tallies, live.greedy, methods)
        result["replay_check"] = live.agree
        result["lossless_mismatches"] = self.lossless["mismatches"]
        result["lossless_ties"] = self.lossless["ties"]
        result["lossless"] = self.lossless
        result["prompts"] = {c: len(ps) for c, ps in selected.items()}
        result["prompt_ids"] = {c: [p.id for p in ps] for c, ps in selected.items()}
        # The length each category decoded to: the benchmark sets a cell beside the same prompts
        # only when it served them to the same length (dspark.serve.offline).
        result["max_new_tokens"] = {c: self.cfg.max_new_tokens[c] for c in selected}
        result["live_prompt_ids"] = [p.id for p in live.prompts]
        result["batch_size"] = cfg.batch_size
        result["resumed_decodes"] = self.records.replayed
        if cfg.lm_eval.limit:
            if progress:
                say(f"evaluate: lm-eval, {cfg.lm_eval.limit} problems per method")
            t0 = time.perf_counter()
            result["quality"] = quality(self.params, self.target, self.llama, chosen, self.context)
            phases["lm_eval"] = time.perf_counter() - t0
        result["phases_s"] = {k: round(v, 1) for k, v in phases.items()}
        result["paths_s"] = {k: round(v, 3) for k, v in self.paths_s.items()}
        return result

    def replay_every_prompt(
        self, selected: dict[str, list[Prompt]], phases: dict[str, float], progress: bool
    ) -> ReplayTallies:
        """The target's path of every prompt, recorded a batch at a time and replayed there by
        every method, n-gram window and Markov variant: their tallies per category."""
        every = [p for ps in selected.values() for p in ps]
        proposers = dict(self.proposers)
        proposers |= {_ngram_label(w): p for w, p in self.ngrams.items()}
        proposers |= {f"dspark_{v}": p for v, p in self.ablation.items()}
        out = ReplayTallies({label: {c: Tally() for c in selected} for label in proposers})
        bars = {
            label: bar(
                total=len(every), desc=f"evaluate: {label}", unit="prompts", enabled=progress
            )
            for label in ["target path", *proposers]
        }
        for step, batch in enumerate(self.batches(every), start=1):
            out.steps = step
            t = time.perf_counter()
            out.wants |= self.paths(batch)
            phases["target_paths"] += time.perf_counter() - t
            bars["target path"].update(len(batch))
            for label, proposer in proposers.items():
                for p, (trace, timing) in zip(
                    batch, self.replay(proposer, label, batch), strict=True
                ):
                    out.per[label][p.category].add(trace, timing)
                    if label == "dspark":
                        out.calibration.add(trace)
                bars[label].update(len(batch))
            # "<method>/..." keys land in the method's child run (tasks/repro.py).
            touched = {p.category for p in batch}
            taus = {f"{m}/tau_{c}": out.per[m][c].tau for c in touched for m in self.proposers}
            self.log.log(out.steps, **{k: v for k, v in taus.items() if v is not None})
        for b in bars.values():
            b.close()
        self._recorded = None
        return out

    def best_window(self, per: dict[str, dict[str, Tally]], nine: list[str]):
        """The n-gram window with the best mean tau over the nine categories, on every prompt
        (None when n-gram is not evaluated)."""
        if not self.windows:
            return None
        return max(
            self.windows, key=lambda w: _mean(per[_ngram_label(w)][c].tau for c in nine) or 0.0
        )

    def decode_live(
        self,
        selected: dict[str, list[Prompt]],
        chosen: dict,
        labels: dict[str, str],
        wants: dict[str, list[int]],
        progress: bool,
    ) -> LiveTallies:
        """The live prompts decoded by every method: greedy (checked against transformers and
        against the replay) and sampled."""
        methods = self.cfg.methods
        out = LiveTallies(
            prompts=self.live_prompts(selected),
            greedy={m: Tally() for m in methods},
            sampled={c: {m: Tally() for m in methods} for c in selected},
        )
        sampling = Sampling(self.cfg.temperature, self.cfg.top_p)
        # `none` drafts nothing to accept or reject: sampled, its tau is 1 by construction.
        drafting = [m for m in methods if m != "none"]
        live_bar = bar(
            total=len(out.prompts) * (len(methods) + len(drafting)), desc="evaluate: live",
            unit="decodes", enabled=progress,
        )  # fmt: skip
        for batch in self.batches(out.prompts):
            for m in methods:
                got = self.decode(chosen[m], labels[m], batch, wants)
                replays = self.replay(chosen[m], labels[m], batch)
                for p, (trace, timing), (again, _) in zip(batch, got, replays, strict=True):
                    out.greedy[m].add(trace, timing)
                    if trace.tokens == wants[p.id]:  # a tie may take the live decode elsewhere
                        out.agree["decodes"] += 1
                        if trace.accepted == again.accepted:
                            out.agree["same"] += 1
                        else:
                            out.agree["differ"].append(f"{p.id}:{m}")
                live_bar.update(len(batch))
            for m in drafting:
                for p, outcome in zip(
                    batch, self.decode(chosen[m], m, batch, sampling=sampling), strict=True
                ):
                    out.sampled[p.category][m].add(*outcome)
                live_bar.update(len(batch))
        live_bar.close()
        self._prefilled = None
        return out


@dataclass
class ReplayTallies:
    """Every replayed proposer's tallies: label -> category -> Tally."""

    per: dict[str, dict[str, Tally]]
    wants: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> the target's path
    calibration: Calibration = field(default_factory=Calibration)  # DSpark's confidence
    steps: int = 0  # batches replayed (the event log's steps)


@dataclass
class LiveTallies:
    """The live decodes' tallies, and how often a live greedy decode accepted as its replay."""

    prompts: list[Prompt]
    greedy: dict[str, Tally]  # method -> Tally
    sampled: dict[str, dict[str, Tally]]  # category -> method -> Tally
    agree: dict = field(default_factory=lambda: {"decodes": 0, "same": 0, "differ": []})


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
            batch_size=params.evaluate.batch_size,
        )
        for m in cfg.methods
    }
    return score(models, cfg.limit, cfg.max_gen_toks)


TIMED = ("tok_s", "decode_tok_s", "draft_share")  # speed: from live decodes only


def _untimed(summary: dict) -> dict:
    """A replayed tally's summary without speed: its target passes were played back."""
    return {k: v for k, v in summary.items() if k not in TIMED}


def overall(tallies, live: dict[str, Tally], methods: list[str]) -> dict:
    """Per method over every prompt: acceptance from the replay, speed from the live decodes
    (the same few rows for every method, so the speedup over `none` compares like with like)."""
    out = {}
    for m in methods:
        total = Tally()
        for c in tallies:
            total.merge(tallies[c][m])
        speed = live[m].summary()
        out[m] = {**_untimed(total.summary()), **{k: speed[k] for k in TIMED}}
        out[m]["live"] = {k: speed[k] for k in ("n", "tau", "tokens")}
    base = out.get("none", {}).get("tok_s")
    for m in methods:
        if base and out[m]["tok_s"]:
            out[m]["speedup"] = round(out[m]["tok_s"] / base, 3)
    return out


def assemble(params, tallies, sampled, ablation_tallies, calibration, sweep, best_window):
    cfg = params.evaluate
    # Each prompt's (emitted, steps) stays beside the summary: the benchmark's served tau is
    # set against the offline one with these (dspark.serve.offline).
    categories = {
        c: {m: {**_untimed(t.summary()), "outcomes": t.outcomes} for m, t in ts.items()}
        for c, ts in tallies.items()
    }
    methods = list(cfg.methods)
    nine = [c for c in CATEGORIES if c in tallies]
    mean = {m: _mean(categories[c][m]["tau"] for c in nine) for m in methods}
    nine_outcomes = {m: {c: tallies[c][m].outcomes for c in nine} for m in methods}
    result = {
        "categories": categories,
        "mean": mean,
        "mean_ci95": {m: mean_tau_interval(nine_outcomes[m]) for m in methods},
        "pairs": pairs(nine_outcomes, cfg.hybrid.draft),
        "ngram_sweep": {
            f"{lo}-{hi}": _mean(by_cat[c].tau for c in nine) for (lo, hi), by_cat in sweep.items()
        },
        "ngram_window": list(best_window) if best_window else None,
        "calibration": calibration.summary(),
    }
    if any(t.steps for ts in sampled.values() for t in ts.values()):
        s_cats = {
            c: {m: t.summary() for m, t in ts.items() if t.steps} for c, ts in sampled.items()
        }
        decoded = [m for m in methods if any(m in s_cats[c] for c in nine)]
        s_mean = {m: _mean(s_cats[c][m]["tau"] for c in nine if m in s_cats[c]) for m in decoded}
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
    result["goals"] = goals(result["pairs"], cfg.goals, cfg.hybrid.draft)
    return result


def pairs(outcomes: dict[str, dict[str, list]], hybrid_draft: str | None = None) -> dict[str, dict]:
    """Mean tau over the nine, method over method on the same prompts, with paired bootstrap
    intervals: every pair of trained drafts, each draft over n-gram, and the hybrid over each of
    its two sources' own methods (its draft's, and n-gram's lookup)."""
    drafts = [m for m in outcomes if m in DRAFT_KINDS.names()]
    wanted = list(combinations(drafts, 2))
    wanted += [(d, "ngram") for d in drafts if "ngram" in outcomes]
    if "hybrid" in outcomes:
        wanted += [("hybrid", m) for m in (hybrid_draft, "ngram") if m in outcomes]
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


def goals(pairs: dict[str, dict], targets: EvalGoals, hybrid_draft: str | None = None) -> dict:
    """The goals of evaluate.goals on the nine-category mean tau, judged on the paired
    interval: met only when all of it clears the goal ('straddles' says the prompts cannot
    tell yet). The hybrid's is judged against both of its sources' methods and shown against
    the stronger (the lower ratio); it is met only where both intervals clear it."""
    out = {}
    for name, pair, goal in (
        ("dspark_over_eagle3", "dspark/eagle3", targets.dspark_over_eagle3),
        ("dspark_over_ngram", "dspark/ngram", targets.dspark_over_ngram),
        ("dspark_over_dflash", "dspark/dflash", targets.dspark_over_dflash),
    ):
        if pair in pairs:
            p = pairs[pair]
            v = verdict(p["ci95"], goal)
            out[name] = {**p, "goal": goal, "verdict": v, "met": v == "met"}
    sources = [pairs[p] for p in (f"hybrid/{hybrid_draft}", "hybrid/ngram") if p in pairs]
    if len(sources) == 2:
        goal = targets.hybrid_over_sources
        verdicts = {verdict(p["ci95"], goal) for p in sources}
        v = next((w for w in ("unknown", "missed", "straddles") if w in verdicts), "met")
        stronger = min(sources, key=lambda p: p["ratio"])
        out["hybrid_over_sources"] = {**stronger, "goal": goal, "verdict": v, "met": v == "met"}
    return out
