"""The evaluate stage on the tiny target with untrained drafts: every method decodes every
category losslessly, the n-gram sweep picks a window, sampling and calibration are reported,
lm-eval scores both methods identically, and bad prompt files fail in one line."""

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch

from dspark.config import load_params
from dspark.data.prompts import read_prompt_file
from dspark.decode.proposers import Proposal, Proposer
from dspark.errors import DataError
from dspark.evaluate.stage import EvalPaths, Evaluation, evaluate_stage, select_prompts
from dspark.io import atomic_dir
from dspark.models.dspark import DSparkDraft
from dspark.train.checkpoint import save_draft
from tests.conftest import ROOT, tool_env, write_jsonl
from tests.unit.test_spec_decode import save_trained_drafts, tiny_drafts

PROMPTS = [
    {"id": "m", "category": "math_reasoning", "prompt": "What is 3 + 4? Then add 5."},
    {"id": "m2", "category": "math_reasoning", "prompt": "Count from one to ten."},
    {"id": "w", "category": "writing", "prompt": "A haiku about rain, rain, rain."},
    {"id": "l", "category": "long_context", "prompt": "the same words again " * 150},
]


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    return save_trained_drafts(tiny_target, tmp_path_factory.mktemp("drafts"))


METHODS = ("dspark", "eagle3", "dflash", "ngram", "none")  # the smoke profile's


def params(*overrides):
    return load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            "evaluate.max_new_tokens.math_reasoning=12",
            "evaluate.max_new_tokens.writing=12",
            "evaluate.max_new_tokens.long_context=12",
            "evaluate.prompts_per_category=2",
            "evaluate.lm_eval.limit=2",
            "evaluate.lm_eval.max_gen_toks=16",
            "evaluate.live_prompts=9",  # every prompt of the nine's here (3)
            *overrides,
        ],
    )


def eval_paths(target_dir, drafts, tmp_path, rows=PROMPTS):
    return EvalPaths(
        target=target_dir,
        drafts=drafts,
        prompts=write_jsonl(tmp_path / "p.jsonl", rows),
        plots=tmp_path / "plots",
        report=tmp_path / "report.md",
        records=tmp_path / "records",
    )


def test_evaluate_every_method_losslessly(tiny_target_dir, drafts, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    paths = EvalPaths(
        target=tiny_target_dir,
        drafts=drafts,
        prompts=prompts,
        plots=tmp_path / "plots",
        report=tmp_path / "report.md",
        records=tmp_path / "records",
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    result = evaluate_stage(params(), paths)
    wall = time.perf_counter() - t0
    assert result["resumed_decodes"] == 0
    assert result["prompts"] == {"math_reasoning": 2, "writing": 1, "long_context": 1}
    phases = result["phases_s"]  # where the stage's time went, every phase measured
    assert set(phases) == {"target_paths", "replay", "live", "lm_eval"}
    assert all(v >= 0 for v in phases.values()) and 0 < sum(phases.values()) < wall
    # The target's own work split: our prefill and decode of the paths, transformers' check;
    # this selection has a long-context prompt and short ones, so every part ran.
    split = result["paths_s"]
    assert set(split) == {
        f"{p}_{k}" for p in ("prefill", "decode", "check") for k in ("short", "long")
    }
    assert all(v > 0 for v in split.values())
    assert sum(split.values()) <= phases["target_paths"] + 0.1  # rounded to 0.1 s
    for cat in result["prompts"]:
        for m in METHODS:
            assert result["categories"][cat][m]["tau"] >= 1.0
    assert result["categories"]["math_reasoning"]["none"]["tau"] == 1.0
    categories = result["categories"].values()
    assert result["lossless_mismatches"] == 0
    # Every prompt's recorded path against transformers', position by position; the three
    # prompts of the nine categories decoded live by the 5 methods, output by output.
    assert result["lossless"]["positions"] == sum(c["none"]["tokens"] for c in categories)
    assert result["lossless"]["checked"] == 3 * len(METHODS)
    assert sorted(result["live_prompt_ids"]) == ["m", "m2", "w"]
    check = result["replay_check"]
    assert check["decodes"] == check["same"] == 3 * len(METHODS), check
    assert tuple(result["ngram_window"]) in {(5, 5), (1, 3)}
    assert set(result["sampling"]["mean"]) == set(METHODS) - {"none"}  # none drafts nothing
    assert result["calibration"]["n"] > 0 and 0 <= result["calibration"]["ece"] <= 1
    q = result["quality"]
    assert q["identical_outputs"] and q["identical_scores"]
    assert set(q["exact_match"]) == {"none", "dspark"}
    for name in ("eval_tau.csv", "eval_pos_accept.csv", "eval_calibration.csv", "eval.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "Lossless: 0 mismatches" in report and "Stage time by phase: target paths" in report

    # A rerun replays every recorded decode (the stage's checkpoint): the same figures, timings
    # included, with nothing decoded again. A record cut short by a stop is dropped, not trusted.
    record = next((tmp_path / "records").glob("*.jsonl"))
    lines = record.read_text().splitlines()
    again = evaluate_stage(params(), paths)
    assert again["resumed_decodes"] == len(lines)
    for key in ("categories", "mean", "overall", "sampling", "calibration", "lossless"):
        assert again[key] == result[key], key
    record.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    cut = evaluate_stage(params(), paths)
    assert cut["resumed_decodes"] == len(lines) - 1 and cut["mean"] == result["mean"]
    # A prompt's new cap decodes that prompt again, and only that one ...
    other = evaluate_stage(params("evaluate.max_new_tokens.writing=10"), paths)
    writing = sum(k.startswith("w|") for k in map(lambda ln: ln.split('"')[3], lines))
    assert other["resumed_decodes"] == len(lines) - writing
    # ... while what decides every decode (here the sampling temperature) starts afresh: the
    # old record goes, even for a selection that decodes far less (one method, one prompt).
    hotter = evaluate_stage(
        params(
            "evaluate.temperature=0.9", "evaluate.methods=[none]", "evaluate.prompts_per_category=1"
        ),
        paths,
    )
    assert hotter["resumed_decodes"] == 0 and len(list((tmp_path / "records").glob("*"))) == 1


def test_missing_draft_is_a_clear_error(tiny_target_dir, tmp_path):
    paths = EvalPaths(
        target=tiny_target_dir,
        drafts=tmp_path / "none-here",
        prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1]),
        plots=tmp_path / "plots",
        report=tmp_path / "r.md",
        records=tmp_path / "records",
    )
    with pytest.raises(DataError, match="no trained dspark draft"):
        evaluate_stage(params(), paths)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"category": "poetry", "prompt": "hi"}', "unknown category 'poetry'"),
        ('{"category": "qa", "prompt": "hi"', "malformed JSON"),
        ('{"category": "qa"}', "exactly one of 'prompt' or 'messages'"),
    ],
)
def test_bad_prompt_file_fails_in_one_line(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    params = ["--params", str(ROOT / "params.yaml"), "--profile", "smoke"]
    proc = subprocess.run(
        [sys.executable, "-m", "dspark", "evaluate", "--prompts", str(bad), *params],
        cwd=tmp_path,  # the stage writes logs/resolved/ first: not into the checkout
        capture_output=True,
        text=True,
        env=tool_env(),
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "bad.jsonl:1" in lines[0], proc.stderr
    assert (tmp_path / "logs" / "resolved" / "evaluate.json").is_file()


def test_long_context_prompts_fit_with_their_chat_template(tiny_target):
    """The long_context budget leaves room for the template, max_new_tokens and one block."""
    from dspark.data.prepare import long_context_tokens
    from dspark.decode.decoder import SpecDecoder
    from dspark.decode.proposers import NgramProposer

    p = load_params(ROOT / "params.yaml", profile="default")
    n = long_context_tokens(p, tiny_target)
    text = "apple" + " apple" * (n - 1)
    assert len(tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"]) == n
    ids = tiny_target.chat_ids([{"role": "user", "content": text}])
    block = p.train.dspark.block_size
    dec = SpecDecoder(None, NgramProposer(block), 0, tiny_target.max_context)
    assert len(ids) > n  # the template adds tokens the text's count does not see
    dec.check_fits(len(ids), p.evaluate.max_new_tokens["long_context"], block)


def test_a_batch_decodes_each_prompt_as_it_decodes_alone(tiny_target_dir, drafts, tmp_path):
    """tau does not depend on the batch: every method's per-prompt tokens, acceptances and tau,
    replayed or live, are those of one-at-a-time decoding, and the reference batched equals it
    alone."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)

    def run(batch: int) -> dict[str, dict]:
        paths = EvalPaths(
            target=tiny_target_dir,
            drafts=drafts,
            prompts=prompts,
            plots=tmp_path / f"plots{batch}",
            report=tmp_path / f"report{batch}.md",
            records=tmp_path / f"records{batch}",
        )
        over = ["evaluate.lm_eval.limit=0"]
        evaluate_stage(params(f"evaluate.batch_size={batch}", *over), paths)
        record = next((tmp_path / f"records{batch}").glob("*.jsonl"))
        recs = [json.loads(line) for line in record.read_text().splitlines()]
        return {r["key"]: r for r in recs}

    alone, together = run(1), run(4)
    assert alone.keys() == together.keys()
    decodes = [k for k in alone if k.endswith(("|greedy", "|replay"))]
    # 4 prompts replayed by 4 methods and 2 n-gram windows; 3 of them decoded live by 5
    assert len(decodes) == 4 * (len(METHODS) - 1 + 2) + 3 * len(METHODS)
    for key in decodes:
        a, b = alone[key]["trace"], together[key]["trace"]
        assert (a["tokens"], a["accepted"], a["emitted"]) == (
            b["tokens"],
            b["accepted"],
            b["emitted"],
        ), key
    for key in (k for k in alone if k.endswith("|reference")):
        assert alone[key]["tokens"] == together[key]["tokens"], key


def test_the_hybrid_is_evaluated_like_every_method(tiny_target_dir, drafts, tmp_path):
    """The hybrid through the stage: lossless on every path and live, live decodes taking its
    replay's steps, the same steps at any batch (its measurements are per request), sampled,
    and its mean tau set against both of its sources' own methods."""
    methods = "evaluate.methods=[dspark, ngram, hybrid, none]"

    def run(batch: int) -> tuple[dict, dict[str, dict]]:
        (tmp_path / str(batch)).mkdir()
        paths = eval_paths(tiny_target_dir, drafts, tmp_path / str(batch))
        over = [methods, f"evaluate.batch_size={batch}", "evaluate.lm_eval.limit=0"]
        result = evaluate_stage(params(*over), paths)
        record = next(paths.records.glob("*.jsonl"))
        recs = [json.loads(line) for line in record.read_text().splitlines()]
        return result, {r["key"]: r for r in recs if r["key"].endswith("|hybrid|replay")}

    (result, alone), (_, together) = run(1), run(4)
    assert result["lossless_mismatches"] == 0 and result["lossless"]["checked"] == 3 * 4
    assert result["replay_check"]["same"] == result["replay_check"]["decodes"] == 3 * 4
    assert all(result["categories"][c]["hybrid"]["tau"] >= 1.0 for c in result["prompts"])
    assert {"hybrid/dspark", "hybrid/ngram"} <= set(result["pairs"])
    assert "hybrid" in result["sampling"]["mean"]
    assert len(alone) == 4 and alone.keys() == together.keys()
    for key, rec in alone.items():
        assert rec["trace"]["accepted"] == together[key]["trace"]["accepted"], key


def test_the_markov_ablation_decodes_beside_dspark(
    tiny_target, tiny_target_dir, tmp_path, monkeypatch, capsys
):
    """What the full profile's evaluate does with train.markov_ablation's drafts: each variant
    decodes every prompt losslessly and is reported beside vanilla DSpark."""
    (dspark, ids), _ = tiny_drafts(tiny_target)
    folder = tmp_path / "drafts"
    variants = {"dspark_gated": {"markov_head": "gated"}, "dspark_rnn": {"markov_head": "rnn"}}
    variants["dspark_rank0"] = {"markov_rank": 0, "confidence_with_markov": False}
    for name, change in {"dspark": {}, **variants}.items():
        torch.manual_seed(1)
        cfg = dataclasses.replace(dspark.cfg, **change)
        model = DSparkDraft(cfg, tiny_target.embed, dspark.lm_head.weight.detach())
        with atomic_dir(folder / name) as tmp:
            save_draft(tmp, model, ids, {})
    paths = EvalPaths(
        target=tiny_target_dir,
        drafts=folder,
        prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1] + PROMPTS[2:3]),
        plots=tmp_path / "plots",
        report=tmp_path / "report.md",
        records=tmp_path / "records",
    )
    p = params(
        "evaluate.methods=[dspark,none]",
        "evaluate.prompts_per_category=1",
        "evaluate.live_prompts=0",
        "evaluate.lm_eval.limit=0",
        "evaluate.batch_size=1",  # a progress line per prompt
    )
    # Each variant's own draft is loaded, by its folder's name.
    loaded = Evaluation(p, tiny_target, paths).ablation
    heads = {v: (d.model.cfg.markov_head, d.model.cfg.markov_rank) for v, d in loaded.items()}
    assert heads == {"gated": ("gated", 16), "rnn": ("rnn", 16), "rank0": ("vanilla", 0)}

    monkeypatch.setattr("dspark.progress.LINE_INTERVAL_S", 0.0)  # a line per batch
    capsys.readouterr()
    result = evaluate_stage(p, paths)
    # Off a terminal (a pipe under Prefect, here pytest's capture), progress is whole lines, a
    # bar per method over the prompts.
    err = capsys.readouterr().err
    for m in ("dspark", "none", "dspark_gated"):
        assert f"evaluate: {m}: 1/2 prompts (50%)" in err, err
        assert f"evaluate: {m}: 2/2 prompts (100%)" in err, err
    assert not any("\r" in ln for ln in err.split("\n") if "evaluate:" in ln)
    abl = result["markov_ablation"]
    assert set(abl) == {"vanilla", "gated", "rnn", "rank0"}
    for variant in ("gated", "rnn", "rank0"):
        assert set(abl[variant]["categories"]) == {"math_reasoning", "writing"}
    # 2 prompts x (dspark, none and the three variants), each replayed under its own label on
    # a path checked against transformers
    assert result["lossless_mismatches"] == 0 and result["lossless"]["positions"] > 0
    records = "".join(f.read_text() for f in paths.records.glob("*.jsonl"))
    for label in ("dspark", "none", "dspark_gated", "dspark_rnn", "dspark_rank0"):
        assert records.count(f"|{label}|replay") == 2, label
    assert "Markov ablation" in paths.report.read_text()
    evaluate_stage(p, paths, progress=False)  # `--no-progress`: replays the records, says nothing
    assert "evaluate:" not in capsys.readouterr().err


class TargetAsDraft(Proposer):
    """Proposes the target's own greedy continuation of each row: every draft is right."""

    name = "target"

    def __init__(self, llama, k):
        self.llama, self.k = llama, k

    def propose(self, seq, n, active, sampling, gen, rows=slice(None)):
        tokens = seq.new_zeros(seq.shape[0], self.k)
        for i in torch.nonzero(active).flatten().tolist():
            ids = seq[i, : int(n[i]) + 1].tolist()
            for j in range(self.k):
                cache = self.llama.new_cache(1, len(ids) + 1)
                logits, _ = self.llama(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
                ids.append(int(logits[0, -1].argmax()))
                tokens[i, j] = ids[-1]
        return Proposal(tokens, torch.where(active, self.k, 0))


def test_the_targets_own_continuation_reaches_k_plus_one_through_the_stage(
    tiny_target, tiny_target_dir, drafts, tmp_path
):
    """Issue 20's oracle: a draft that proposes what the target will say emits k + 1 tokens on
    every verify step but a prompt's last, replayed and live, through the evaluation itself."""
    paths = eval_paths(tiny_target_dir, drafts, tmp_path)
    p = params("evaluate.methods=[dspark,none]", "evaluate.lm_eval.limit=0")
    ev = Evaluation(p, tiny_target, paths)
    k = ev.proposers["dspark"].k
    ev.proposers["dspark"] = TargetAsDraft(ev.llama, k)
    result = ev.all(select_prompts(read_prompt_file(paths.prompts), 2, 1), progress=False)
    for cat, row in result["categories"].items():
        for emitted, steps in row["dspark"]["outcomes"]:
            assert steps == -(-emitted // (k + 1)), (cat, emitted, steps)  # ceil
    assert result["overall"]["dspark"]["pos_accept"] == [1.0] * k
    live = result["overall"]["dspark"]["live"]
    # live, at the 12-token cap: the 11 tokens after the prefill's in ceil(11 / (k + 1)) steps
    assert live["n"] == 3 and live["tau"] == pytest.approx(11 / -(-11 // (k + 1)), abs=1e-4)


def test_categories_pick_what_is_evaluated_and_live_prompts_go_shortest_first(
    tiny_target, tiny_target_dir, drafts, tmp_path
):
    """`evaluate.categories` names what a profile evaluates (a category the eval set lacks is an
    error before anything loads); live prompts go each category's shortest first, the categories
    in the order of their shortest prompt (math's 22 characters before writing's 31)."""
    paths = eval_paths(tiny_target_dir, drafts, tmp_path)
    with pytest.raises(DataError, match=r"^evaluate\.categories: .* no 'HumanEval' prompts"):
        evaluate_stage(params("evaluate.categories=[writing, HumanEval]"), paths)
    ev = Evaluation(params(), tiny_target, paths)
    live = ev.live_prompts(select_prompts(read_prompt_file(paths.prompts), 2, 1))
    assert [p.id for p in live] == ["m2", "w", "m"]


def test_lm_eval_problems_decode_batched_as_one_at_a_time(tiny_target):
    """The lm-eval model decodes problems that share a cap together: the same answers, in the
    requests' order, as one at a time (greedy does not depend on the batch)."""
    from dspark.decode.proposers import NoProposer
    from dspark.evaluate.quality import SpecLM

    asks = ["What is 2 + 2?", "Name a color.", "Count to three, slowly.", "Say hi."]
    caps = [10, 6, 10, 10]  # two caps: two groups, answers interleaved in the request order
    requests = [
        dataclasses.make_dataclass("Req", ["args"])((a, {"max_gen_toks": c, "until": ["\n\n"]}))
        for a, c in zip(asks, caps, strict=True)
    ]

    def answers(batch_size: int) -> tuple[list[str], list[list[int]]]:
        lm = SpecLM(tiny_target, proposer=NoProposer(), batch_size=batch_size)
        return lm.generate_until(requests, disable_tqdm=True), lm.outputs

    alone, together = answers(1), answers(2)
    assert alone == together
    assert all(0 < len(t) <= c for t, c in zip(alone[1], caps, strict=True))
    for bad in (0, "auto"):
        with pytest.raises(ValueError, match="batch_size"):
            SpecLM(tiny_target, proposer=NoProposer(), batch_size=bad)
