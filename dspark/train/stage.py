"""The train stage: the drafts train.drafts names (each started by its kind's recipe,
train/recipes.py) trained side by side on the same hidden states, then written as draft folders
with their curves and metrics.

    online   (extract.mode online) the trainer consumes the Mooncake stream itself
    offline  (offline, hybrid)     the trainer reads the extract stage's hidden-state shards

With train.world_size N > 1 this process is rank 0 of N data-parallel ranks (distributed.py):
every rank prepares the same drafts and trains on its share of each batch; rank 0 alone
evaluates and writes the outputs.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.codedeps import ROOT as CODE_ROOT
from dspark.codedeps import closure
from dspark.config import MARKOV_ABLATION, Params, check_ranks
from dspark.data.shards import iter_samples
from dspark.data.shards import read_manifest as read_token_manifest
from dspark.drafts import DRAFT_KINDS
from dspark.errors import ConfigError, DataError
from dspark.extract.capture import resolve_aux_layers
from dspark.io import atomic_dir, atomic_path
from dspark.metrics import EventLog
from dspark.models.layers import LayerShape
from dspark.models.target import Target, load_target_for, read_manifest, set_threads
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.stopping import on_signals
from dspark.train.batch import TargetHead
from dspark.train.checkpoint import save_draft
from dspark.train.curves import fit_history
from dspark.train.distributed import (
    CPU,
    Ranks,
    join_launcher,
    rank_device,
    spawn_ranks,
    under_launcher,
)
from dspark.train.recipes import Setup
from dspark.train.sources import HiddenShards, open_source, split_eval
from dspark.train.trainer import DraftRun, Trainer, fingerprint


@dataclass(frozen=True)
class TrainPaths:
    target: Path
    shards: Path
    hidden: Path
    drafts: Path  # one folder per draft
    checkpoint: Path
    curves_csv: Path
    curves_png: Path
    events: Path | None = None


def resolve_mask_token(requested: int | None, target: Target, counts: torch.Tensor) -> int:
    """`requested`, or the first special token the training responses never use."""
    if requested is not None:
        if not 0 <= requested < target.vocab_size:
            raise ConfigError(
                f"train.dspark.mask_token_id: {requested} is outside the target's "
                f"{target.vocab_size}-token vocabulary"
            )
        return requested
    tok = target.tokenizer
    taken = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    special = sorted(getattr(tok, "added_tokens_decoder", {}) or {})
    for tid in special:
        if tid not in taken and int(counts[tid]) == 0:
            return int(tid)
    raise ConfigError("train.dspark.mask_token_id: no unused special token; set one")


def build_runs(
    params: Params,
    target: Target,
    draft_ids: torch.Tensor,
    aux_layers: list[int],
    mask_id: int,
    device: torch.device = CPU,
) -> list[DraftRun]:
    """The drafts train.drafts names, each started by its kind's recipe (dspark.drafts), in
    the registry's order, initialized alike (seeded), on `device`."""
    setup = Setup(
        params=params,
        target=target,
        shape=LayerShape.from_hf(target.model.config.to_dict()),
        # The drafts borrow the target's embedding outside their module tree: `.to` would miss it.
        embed=target.embed.to(device),
        rows=target.lm_head.weight.detach()[draft_ids].clone(),
        draft_ids=draft_ids,
        aux_layers=tuple(aux_layers),
        mask_id=mask_id,
        device=device,
    )
    return [
        DraftRun(**vars(recipe))
        for kind in DRAFT_KINDS.values()
        if kind.name in params.train.drafts
        for recipe in kind.recipes(setup)
    ]


@dataclass
class Start:
    """The drafts as the stage starts them, and what they were built from."""

    runs: list[DraftRun]
    draft_ids: torch.Tensor  # the draft vocabulary
    counts: torch.Tensor  # [V] the training answers' token counts
    mask_id: int


def starting_drafts(
    params: Params,
    paths: TrainPaths,
    target: Target,
    held: set[int],
    aux_layers: list[int],
    device: torch.device = CPU,
) -> Start:
    """The vocabulary is the training answers' most frequent tokens (the `held` samples' not
    counted) and the mask token the first special token they never use."""
    t = params.train
    counts = count_tokens(
        (s for s in answered_samples(params, paths) if s.sample_id not in held), target.vocab_size
    )
    if not int(counts.sum()):
        raise DataError(
            f"{paths.shards}: no response tokens to build the draft vocabulary from "
            "(prepare.engine extract: train on the extract stage's shards)"
        )
    draft_ids = build_draft_ids(counts, t.draft_vocab_size, always=[target.eos_token_id])
    mask_id = resolve_mask_token(t.dspark.mask_token_id, target, counts)
    runs = build_runs(params, target, draft_ids, aux_layers, mask_id, device)
    return Start(runs, draft_ids, counts, mask_id)


def run_fingerprint(params: Params, paths: TrainPaths, tokens_doc: dict) -> str:
    """Everything DVC would rerun this stage for: a checkpoint with another fingerprint is
    started over, never resumed."""
    hidden_manifest = paths.hidden / "manifest.json"
    return fingerprint(
        code_hash(),
        params.target.model_dump(mode="json"),
        # Results do not depend on the world size: a checkpoint resumes on any number of ranks.
        params.train.model_dump(mode="json", exclude={"world_size"}),
        params.extract.model_dump(mode="json"),
        read_manifest(paths.target),
        [s["sha256"] for s in tokens_doc["shards"]],
        file_digest(hidden_manifest) if hidden_manifest.is_file() else None,
    )


def train_stage(params: Params, paths: TrainPaths, progress: bool = True) -> dict:
    """Run the stage; return its metrics. With train.world_size > 1 this process is rank 0
    and starts the other ranks."""
    check_ranks(params.train, params.extract)
    if under_launcher():
        with join_launcher(params) as ranks:
            return train_rank(params, paths, progress=progress and ranks.leader, ranks=ranks)
    if params.train.world_size == 1:
        return train_rank(params, paths, progress=progress)
    with spawn_ranks(params, paths) as ranks:
        return train_rank(params, paths, progress=progress, ranks=ranks)


def answered_samples(params: Params, paths: TrainPaths) -> Iterator:
    """The training samples with their answers: the token shards', or the extract stage's
    hidden shards' where its producers answered the prompts (prepare.engine extract)."""
    if params.prepare.engine == "extract":
        shards = HiddenShards(paths.hidden)
        return shards.read(shards.ids)
    return iter_samples(paths.shards)


def train_rank(
    params: Params, paths: TrainPaths, *, progress: bool = True, ranks: Ranks | None = None
) -> dict:
    """One rank's part of the stage (all of it without `ranks`); {} on ranks other than 0."""
    t = params.train
    lead = ranks is None or ranks.leader
    # The ranks share the cores unless told otherwise.
    set_threads(t.threads or (max(1, (os.cpu_count() or 1) // ranks.world) if ranks else None))
    target = load_target_for(params.target, paths.target)
    tokens_doc = read_token_manifest(paths.shards)
    drawn = tokens_doc.get("validation_samples")
    if drawn is not None and drawn != t.eval_samples:
        raise DataError(
            f"train.eval_samples: {t.eval_samples}, but prepare drew {drawn} validation samples "
            "from data.val_sources (rerun prepare)"
        )
    train_ids, eval_ids = split_eval(list(range(tokens_doc["num_samples"])), t.eval_samples)
    aux = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    device = ranks.device if ranks else rank_device(t.device)
    start = starting_drafts(params, paths, target, set(eval_ids), aux, device)
    runs, draft_ids, counts = start.runs, start.draft_ids, start.counts
    head = TargetHead(target.norm, target.lm_head, draft_ids).to(device)  # batches form there
    online = params.extract.mode == "online"
    fp = run_fingerprint(params, paths, tokens_doc)
    trainer = Trainer(
        cfg=t,
        runs=runs,
        head=head,
        checkpoint_dir=paths.checkpoint,
        fingerprint=fp,
        events=EventLog(paths.events) if lead else None,
        progress=progress and lead,
        ranks=ranks,
        eval_sources=dict(enumerate(tokens_doc["validation_sources"]))
        if tokens_doc.get("validation_sources")
        else None,
    )

    source = functools.partial(
        open_source,
        params,
        target_dir=paths.target,
        shards_dir=paths.shards,
        hidden_dir=paths.hidden,
        online=online,
        ranks=ranks,
    )
    with on_signals() as stop:  # SIGTERM or Ctrl-C: checkpoint after this step, then stop
        trainer.stop = stop
        loop = trainer.fit(source, train_ids, eval_ids)
    if not lead:
        return {}
    coverage = float(counts[draft_ids].sum() / counts.sum().clamp_min(1))
    provenance = {
        "target": read_manifest(paths.target).get("source"),
        "aux_layers": aux,
        "steps": trainer.step,
        "tokens": trainer.tokens,
        "fingerprint": fp,
    }
    with atomic_dir(paths.drafts) as tmp:
        for run in runs:
            (tmp / run.name).mkdir()
            save_draft(tmp / run.name, run.model, draft_ids, {"provenance": provenance})
    write_curves(runs, paths.curves_csv, paths.curves_png)
    return {
        "source": "stream" if online else "shards",
        "world_size": t.world_size,
        "train_samples": len(train_ids),
        "eval_samples": len(eval_ids),
        "draft_vocab_size": int(draft_ids.numel()),
        "draft_vocab_coverage": round(coverage, 4),
        "mask_token_id": start.mask_id,
        **loop,
        **summarize(runs, trainer.tokens),
    }


def code_hash() -> str:
    """The library code the stage runs: the files DVC hashes for it (`dspark.codedeps`)."""
    h = hashlib.sha256()
    for rel in closure({__name__, "dspark.config"}):
        h.update(rel.encode() + (CODE_ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def summarize(runs: list[DraftRun], tokens: int) -> dict:
    """Per-draft figures, the Markov ablation, and the wall-clock goal."""
    out: dict = {}
    for run in runs:
        entry = {
            "tau_sim": run.last_eval.get("tau_sim"),
            "pos_accept": run.last_eval.get("pos_accept"),
            "tau_greedy": run.last_eval.get("tau_greedy"),
            "pos_greedy": run.last_eval.get("pos_greedy"),
            "cond_greedy": run.last_eval.get("cond_greedy"),
            "copy": run.last_eval.get("copy"),
            "tau_decode": run.last_eval.get("tau_decode"),
            "final_loss": run.last_eval.get("loss"),
            "tokens_per_s": round(tokens / run.wall_s, 1) if run.wall_s else None,
            "wall_s": round(run.wall_s, 2),
            "params": sum(p.numel() for p in run.params),
            "curve": run.curve,
            "history": run.history,
        }
        if run.by_source:  # data.val_sources: the held-out figures of each source
            keys = ("tau_sim", "pos_accept", "tau_greedy", "pos_greedy", "tau_decode")
            entry["by_source"] = {
                name: {k: r.get(k) for k in keys} for name, r in run.by_source.items()
            }
        if run.name in MARKOV_ABLATION:
            out.setdefault("markov_ablation", {})[run.name.removeprefix("dspark_")] = entry
        else:
            out[run.name] = entry
    if "markov_ablation" in out and "dspark" in out:
        out["markov_ablation"]["vanilla"] = {k: v for k, v in out["dspark"].items() if k != "curve"}
    if "dspark" in out and "eagle3" in out:
        out["goal"] = wall_clock_goal(out["dspark"]["curve"], out["eagle3"])
    out["fits"] = curve_fits(runs)
    return out


def curve_fits(runs: list[DraftRun]) -> dict:
    """Each draft's held-out tau_decode over steps, fitted (train/curves.py): its level, its
    value at 2x and 10x this run's steps and, for the block drafts, the steps the fit needs to
    reach EAGLE-3's final figure. Drafts with too few evaluations are left out."""
    final = {r.name: r.last_eval.get("tau_decode") for r in runs}
    out = {}
    for run in runs:
        fit = fit_history(run.history)
        if fit is not None:
            reach = final.get("eagle3") if run.name != "eagle3" else None
            out[run.name] = fit.summary(reach)
    return out


def wall_clock_goal(dspark_curve: list[list[float]], eagle3: dict) -> dict:
    """When DSpark reaches EAGLE-3's final tau_sim, as a share of EAGLE-3's wall time
    (goal: at most 0.5). Linear interpolation between the held-out evaluations."""
    target_tau = eagle3["tau_sim"]
    start_tau = eagle3["curve"][0][2] if eagle3["curve"] else None
    if start_tau is None or target_tau is None or target_tau - start_tau < 0.01:
        return {
            "eagle3_final_tau_sim": target_tau,
            "met": None,
            "note": "EAGLE-3 did not improve on its untrained tau_sim: nothing to compare",
        }
    reached = None
    prev = None
    for wall, _tokens, tau, *_greedy in dspark_curve:
        if tau is not None and tau >= target_tau:
            if prev is None or prev[1] >= target_tau:
                reached = wall
            else:
                frac = (target_tau - prev[1]) / (tau - prev[1])
                reached = prev[0] + frac * (wall - prev[0])
            break
        prev = (wall, tau)
    ratio = (
        round(reached / eagle3["wall_s"], 4) if reached is not None and eagle3["wall_s"] else None
    )
    return {
        "eagle3_final_tau_sim": target_tau,
        "dspark_wall_s_to_reach": None if reached is None else round(reached, 2),
        "eagle3_wall_s": eagle3["wall_s"],
        "ratio": ratio,
        "met": ratio is not None and ratio <= 0.5,
    }


def write_curves(runs: list[DraftRun], csv_path: Path, png_path: Path) -> None:
    """Held-out tau_sim (and, dashed, greedy tau) against training tokens and against wall
    time, one colour per draft."""
    with atomic_path(csv_path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["draft", "wall_s", "tokens", "tau_sim", "tau_greedy"])
        for run in runs:
            for wall, tokens, tau, *greedy in run.curve:
                w.writerow([run.name, wall, tokens, tau, greedy[0] if greedy else None])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        walls = [point[0] for point in run.curve]
        toks = [point[1] for point in run.curve]
        taus = [point[2] for point in run.curve]
        greedy = [point[3] if len(point) > 3 else None for point in run.curve]
        for ax, xs in ((axes[0], toks), (axes[1], walls)):
            (line,) = ax.plot(xs, taus, marker="o", ms=3, label=f"{run.name} tau_sim")
            if any(g is not None for g in greedy):
                kept = [(x, g) for x, g in zip(xs, greedy, strict=True) if g is not None]
                ax.plot(
                    *zip(*kept, strict=True),
                    ls="--",
                    color=line.get_color(),
                    marker="x",
                    ms=3,
                    label=f"{run.name} greedy",
                )
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("draft wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out acceptance length")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
