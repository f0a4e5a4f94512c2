"""Held-out greedy acceptance measured twice on the same samples: as the train stage measures
it, and by decoding through the evaluation's decoder. Set beside each other they separate "the
trainer's measure is not what decoding gets" from "the evaluation's prompts are not the training
data's", the two readings of a held-out tau above the evaluation's.

    python -m evals.heldout_decode [--profile full] [--samples 64] [--checkpoint]

Reads the train stage's validation split (`train.eval_samples`, the lowest sample ids) from the
extract stage's hidden shards, and each trained draft in artifacts/drafts, or with
`--checkpoint` the drafts at the stage's last checkpoint (a run part-way: rebuilt as the stage
builds them, refused if the checkpoint is another configuration's).

- trainer: `tau_greedy` and `tau_decode` as train.json reports them. Every response position is
  an anchor, each slot is given the sample's tokens before it, and a block counts up to its
  first slot whose argmax is not the target's greedy token; tau_greedy averages that over the
  anchors (where a whole block is supervised), tau_decode walks the anchors as greedy decoding
  steps (AcceptanceStats.tau_decode), over the whole answer.
- decode: the samples are the target's greedy answers (on-policy extraction with greedy
  sampling), so a sample's tokens are the greedy path and its shard holds the target's features
  along it. A `Playback` of them stands in for the target (`dspark.decode.replay`) and
  `SpecDecoder` decodes the prompt with the draft's proposer: anchors fall where decoding puts
  them, and tau is emitted tokens per verify step, as the evaluation counts it.

A decode stops k + 2 tokens before its answer ends: a verify pass looks k positions ahead, and
the shard holds nothing past the answer. Writes metrics/studies/heldout_decode.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.config import Params, load_params
from dspark.data.shards import read_manifest as read_token_manifest
from dspark.decode.decoder import SpecDecoder
from dspark.decode.proposers import Proposer
from dspark.decode.replay import Playback, Recording
from dspark.drafts import DRAFT_KINDS, load_draft
from dspark.errors import DataError, DsparkError
from dspark.evaluate.summary import Tally
from dspark.extract.capture import resolve_aux_layers
from dspark.metrics import write_metrics
from dspark.models.eagle3 import Eagle3Draft
from dspark.models.target import load_target_for
from dspark.pipeline import DRAFTS, HIDDEN, SHARDS, TARGET_DIR, TRAIN_CHECKPOINT
from dspark.schema import Sample
from dspark.train.batch import TargetHead, collate
from dspark.train.checkpoint import load_state, load_tensors, read_state
from dspark.train.losses import LossWeights
from dspark.train.objectives import DSparkObjective, Eagle3Objective
from dspark.train.sources import HiddenShards, split_eval
from dspark.train.stage import TrainPaths, run_fingerprint, starting_drafts
from dspark.train.trainer import measure

ROOT = Path(__file__).resolve().parents[1]


def prompt_length(sample: Sample) -> int:
    """Positions before the first response token."""
    return int(sample.loss_mask.int().argmax())


def recording(sample: Sample, layers: list[int]) -> Recording:
    """The sample as a one-row recording of its greedy path: the choice after each position is
    the next token, the tapped features are the shard's (layers: the shard's aux layer order)."""
    ids = sample.input_ids.long()
    next_token = torch.zeros(1, ids.shape[0], dtype=torch.long)
    next_token[0, :-1] = ids[1:]
    feats = {layer: sample.aux_hidden[i].float()[None] for i, layer in enumerate(layers)}
    return Recording(next_token, feats, torch.tensor([ids.shape[0] - 1]))


def decode_tallies(
    proposer: Proposer, samples: list[Sample], layers: list[int], vocab: int, eos: int
) -> dict[int, Tally]:
    """Each sample decoded alone through a playback of it -> {sample id: the evaluation's tally}
    (samples with no room to decode are left out)."""
    tallies = {}
    for x in samples:
        p = prompt_length(x)
        room = x.num_tokens - p - proposer.k - 2
        if room < 1:
            continue
        playback = Playback(recording(x, layers), vocab)
        decoder = SpecDecoder(playback, proposer, eos, max_context=x.num_tokens)
        traces, timing = decoder.generate([x.input_ids[:p].tolist()], room)
        tokens = traces[0].tokens
        if tokens != x.input_ids[p : p + len(tokens)].tolist():  # the path is given
            raise RuntimeError(f"sample {x.sample_id}: the decode left the recorded answer")
        tallies[x.sample_id] = Tally()
        tallies[x.sample_id].add(traces[0], timing)
    return tallies


def trainer_measure(model, draft_ids, samples: list[Sample], target, batch_size: int) -> dict:
    """The train stage's held-out measure of a trained draft (acceptance does not depend on
    the loss weights, so the objective's defaults stand in for the training recipe's), and how
    often the samples' next token is the target's greedy one (1 on the target's own greedy
    answers, up to near-ties; counted where that token is in the draft vocabulary)."""
    head = TargetHead(target.norm, target.lm_head, draft_ids)
    if isinstance(model, Eagle3Draft):
        objective, slots = Eagle3Objective(LossWeights(kl=1.0)), model.cfg.ttt_steps
    else:
        objective, slots = DSparkObjective(LossWeights(), None), model.cfg.draft_slots
    batches = [
        collate(samples[i : i + batch_size], head) for i in range(0, len(samples), batch_size)
    ]
    result = measure(model, objective, slots, batches)
    on_path = known = 0
    for b in batches:
        at = b.valid[:, :-1] & (b.greedy[:, :-1] >= 0)  # position t, its next token x_{t+1}
        greedy = draft_ids[b.greedy[:, :-1].clamp_min(0)]
        on_path += int((at & (greedy == b.input_ids[:, 1:])).sum())
        known += int(at.sum())
    result["greedy_path"] = round(on_path / known, 4) if known else None
    return result


def trained_drafts(root: Path, names: list[str], target) -> tuple[dict, str]:
    """{name: (model, draft ids)} of the train stage's output, and where they came from."""
    return {n: load_draft(root / DRAFTS / n, target.embed) for n in names}, str(root / DRAFTS)


def checkpoint_drafts(params, root: Path, names: list[str], target) -> tuple[dict, str]:
    """The drafts at the train stage's last checkpoint, rebuilt as the stage builds them."""
    paths = TrainPaths(
        target=root / TARGET_DIR,
        shards=root / SHARDS,
        hidden=root / HIDDEN,
        drafts=root / DRAFTS,
        checkpoint=root / TRAIN_CHECKPOINT,
        curves_csv=root / "plots",  # not written here
        curves_png=root / "plots",
    )
    state = read_state(paths.checkpoint)
    tokens_doc = read_token_manifest(paths.shards)
    if state.get("fingerprint") != run_fingerprint(params, paths, tokens_doc):
        raise DataError(
            f"{paths.checkpoint}: made by another configuration (params, data or code) than "
            f"{root}'s: it would not resume there either"
        )
    _, held = split_eval(list(range(tokens_doc["num_samples"])), params.train.eval_samples)
    aux = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    start = starting_drafts(params, paths, target, set(held), aux)
    out = {}
    for run in start.runs:
        if run.name in names:
            where = paths.checkpoint / f"{run.name}.safetensors"
            load_state(run.model, load_tensors(where), where)
            out[run.name] = (run.model, start.draft_ids)
    missing = sorted(set(names) - set(out))
    if missing:
        raise DataError(f"{paths.checkpoint}: no {missing[0]} draft in it")
    return out, f"{paths.checkpoint} at step {state['step']}"


def compare(
    model, draft_ids, groups: dict[str, list[Sample]], layers: list[int], target, batch: int
) -> dict[str, dict]:
    """One trained draft: the trainer's figures and the decode's for each group of samples."""
    proposer = DRAFT_KINDS.get(model.cfg.kind).proposer(model, draft_ids)
    every = {x.sample_id: x for members in groups.values() for x in members}
    decoded = decode_tallies(
        proposer, list(every.values()), layers, target.vocab_size, target.eos_token_id
    )
    out = {}
    for group, members in groups.items():
        trained = trainer_measure(model, draft_ids, members, target, batch)
        tally = Tally()
        for x in members:
            if x.sample_id in decoded:
                tally.merge(decoded[x.sample_id])
        summary = tally.summary()
        out[group] = {
            "trainer_tau_greedy": trained.get("tau_greedy"),
            "trainer_tau_decode": trained.get("tau_decode"),
            "trainer_tau_sim": trained["tau_sim"],
            "trainer_slot0_greedy": (trained.get("pos_greedy") or [None])[0],
            "greedy_path": trained["greedy_path"],
            "decode_tau": summary["tau"],
            "decode_tau_ci95": summary["tau_ci95"],
            "decode_slot0": summary["pos_accept"][0] if summary["pos_accept"] else None,
            "decode_steps": summary["verify_steps"],
            "samples": summary["n"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=None, help="params.yaml profile (default: its own)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the workspace the stages ran in")
    ap.add_argument("--samples", type=int, default=None, help="default: train.eval_samples")
    ap.add_argument("--drafts", nargs="*", default=None, help="default: train.drafts")
    ap.add_argument(
        "--checkpoint", action="store_true", help="the drafts at the train stage's last checkpoint"
    )
    ap.add_argument("--out", type=Path, default=None)
    return one_line_errors(run, ap.parse_args(argv))


def one_line_errors(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """A tool's run: a bad input is one line on stderr and exit code 2."""
    try:
        run(args)
    except DsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def validation_samples(
    root: Path, params: Params, count: int | None
) -> tuple[list[Sample], list[int], list[str] | None]:
    """The first `count` samples of the train stage's validation split (`train.eval_samples`,
    the lowest sample ids) from the extract stage's hidden shards, the shards' aux layers, and
    each sample id's source where the token shards record it (None otherwise)."""
    manifest = read_token_manifest(root / SHARDS)
    _, held = split_eval(list(range(manifest["num_samples"])), params.train.eval_samples)
    shards = HiddenShards(root / HIDDEN)
    samples = list(shards.read(held[:count]))
    return samples, list(shards.manifest["aux_layers"]), manifest.get("validation_sources")


def run(args: argparse.Namespace) -> None:
    root = args.root
    params = load_params(root / "params.yaml", args.profile)
    target = load_target_for(params.target, root / TARGET_DIR)
    samples, layers, sources = validation_samples(root, params, args.samples)
    groups: dict[str, list[Sample]] = {"all": samples}
    if sources and len(set(sources)) > 1:  # each source apart too, as train.json's by_source
        for x in samples:
            groups.setdefault(sources[x.sample_id], []).append(x)

    names = args.drafts or list(params.train.drafts)
    if args.checkpoint:
        drafts, where = checkpoint_drafts(params, root, names, target)
    else:
        drafts, where = trained_drafts(root, names, target)
    print(f"{len(samples)} held-out samples; drafts: {where}")
    columns = ("draft", "samples", "on greedy path", "trainer tau_greedy", "trainer tau_decode")
    print("| " + " | ".join((*columns, "decode tau [95%]", "slot 0: trainer, decode")) + " |")
    print("|---" * 7 + "|")
    doc: dict[str, dict] = {}
    for name, (model, draft_ids) in drafts.items():
        doc[name] = compare(model, draft_ids, groups, layers, target, params.train.batch_size)
        for group, f in doc[name].items():
            lo, hi = f["decode_tau_ci95"] or (None, None)
            print(
                f"| {name} | {group} ({f['samples']}) | {f['greedy_path']} | "
                f"{f['trainer_tau_greedy']} | {f.get('trainer_tau_decode')} | "
                f"{f['decode_tau']} [{lo}, {hi}] | {f['trainer_slot0_greedy']}, "
                f"{f['decode_slot0']} |",
                flush=True,
            )
    out = args.out or root / "metrics" / "studies" / "heldout_decode.json"
    write_metrics(out, params.profile, {"samples": len(samples), "from": where, "drafts": doc})
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
