"""The training loop: every draft steps on the same batch, in turn, so the comparison is over
the same tokens in the same order, timed per draft on the same (noisy, shared) machine.

A draft's wall time is its own forward, backward and optimizer step plus the batch's
preparation (padding and the target's distributions, which every draft needs). Data waiting
and held-out evaluation are counted apart. Checkpoints hold everything a bit-exact resume needs:
weights, AdamW state, the position in the plan and the curves so far; anchor sampling draws
from a generator seeded by the step, so no RNG state has to be carried. A stop request (see
dspark.stopping) is honoured between steps: checkpoint, then Stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from dspark.config import OptimConfig, TrainConfig
from dspark.errors import DataError
from dspark.io import atomic_dir, old_name, space_for, write_json
from dspark.metrics import EventLog
from dspark.progress import bar as progress_bar
from dspark.schema import Sample
from dspark.stopping import Stopped, StopRequest
from dspark.train import checkpoint as ckpt
from dspark.train.batch import Batch, TargetHead, collate
from dspark.train.diagnostics import CopyBias, recent_tokens
from dspark.train.distributed import Part, Ranks, data_parallel
from dspark.train.losses import AcceptanceStats
from dspark.train.objectives import anchor_candidates
from dspark.train.recipes import Recipe
from dspark.train.sources import Source, epoch_plan

STATE = "state.json"
log = logging.getLogger("dspark.train")


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Linear warmup over `warmup_fraction` of the steps, then the schedule to zero."""
    warmup = math.ceil(cfg.warmup_fraction * total)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - warmup) / max(1, total - warmup)
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def cut(plans: list[list[list[int]]], max_steps: int | None) -> list[list[list[int]]]:
    """The epochs' batch plans up to `max_steps` batches in all (None: all of them)."""
    if max_steps is None:
        return plans
    out, left = [], max_steps
    for plan in plans:
        if left <= 0:
            break
        out.append(plan[:left])
        left -= len(out[-1])
    return out


def settle(device: torch.device) -> None:
    """Wait for the work queued on `device`, so that a timer read next counts it (CUDA runs
    asynchronously: unsettled, one draft's optimizer step would be timed as the next's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DraftRun(Recipe):
    """One draft in training: its recipe (model, objective, optimizer settings), its optimizer
    and its record."""

    wall_s: float = 0.0
    # [wall_s, tokens, tau_sim, tau_greedy] per held-out evaluation (checkpoints of older code
    # hold the first three)
    curve: list[list[float]] = field(default_factory=list)
    last_eval: dict = field(default_factory=dict)
    # Per held-out evaluation: step, tokens, wall_s, tau_decode and the per-slot greedy
    # acceptance, marginal and conditional (the curves train/curves.py fits).
    history: list[dict] = field(default_factory=list)
    by_source: dict[str, dict] = field(default_factory=dict)  # the last eval, per source

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.optim.lr,
            betas=self.optim.betas,
            weight_decay=self.optim.weight_decay,
        )
        self.parallel: nn.Module | None = None  # the objective under DDP, when data-parallel

    def data_parallel(self, ranks: Ranks) -> None:
        """Train as one of `ranks`, each normalizing its loss by the global batch."""
        self.objective = replace(self.objective, total=ranks.sum)
        self.parallel = data_parallel(self.model, self.objective, ranks.device)

    def step(
        self,
        batch: Batch,
        step: int,
        total: int,
        seed: int,
        prep_s: float,
        part: Part | None = None,
    ) -> dict:
        """One optimizer step on `batch`: the whole global batch, or this rank's `part` of it."""
        self.model.train()
        lr = lr_at(step, total, self.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        if part is not None:
            self.objective.skip(gen, part.rows_before)
        t0 = time.perf_counter()
        if self.parallel is None:
            out = self.objective(self.model, batch, gen)
        else:
            out = self.parallel(batch, gen)
        stats = AcceptanceStats(self.slots)
        stats.add(out["accept"], out["mask"])
        losses = {k: v.detach() for k, v in out.items() if k.startswith("loss")}
        tokens = batch.tokens
        if part is not None:  # every rank sees the global figures, and fails together
            losses, tokens = part.reduce(losses, stats), part.tokens
        if not torch.isfinite(losses["loss"]):
            raise DataError(
                f"train: {self.name}: non-finite loss at step {step}; the checkpoint keeps the "
                "last good state"
            )
        self.optimizer.zero_grad(set_to_none=True)
        if part is None:
            out["loss"].backward()
        else:
            # DDP averages the ranks' gradients; each loss is a share of the global mean, so
            # scaling by the world size makes the average their sum: one process's gradient.
            (out["loss"] * part.ranks.world).backward()
        clip = self.optim.grad_clip if self.optim.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.optimizer.step()
        settle(self.params[0].device)
        spent = time.perf_counter() - t0 + prep_s
        self.wall_s += spent
        metrics = {k: float(v) for k, v in losses.items()}
        metrics.update(
            tau_sim=stats.tau,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=tokens / spent,
            wall_s=self.wall_s,
        )
        for k, rate in enumerate(stats.pos_accept):
            metrics[f"accept_{k}"] = rate
        return metrics

    def evaluate(self, batches: list[Batch]) -> dict:
        """Measure on held-out batches and keep it as the draft's last evaluation."""
        self.last_eval = self.measure(batches)
        return self.last_eval

    def measure(self, batches: list[Batch]) -> dict:
        return measure(self.model, self.eval_objective, self.slots, batches)


@torch.no_grad()
def measure(model: nn.Module, objective: Callable, slots: int, batches: list[Batch]) -> dict:
    """Held-out acceptance of `model` (put in eval mode) under `objective`, over `slots`."""
    model.eval()
    stats = AcceptanceStats(slots)
    copies = CopyBias()
    losses = []
    for batch in batches:
        out = objective(model, batch, None)
        stats.add(out["accept"], out["mask"], out.get("greedy_accept"), out.get("at"))
        losses.append(float(out["loss"]))
        if "proposed" in out and batch.greedy is not None and batch.draft_input is not None:
            at = out["at"]
            truth = batch.greedy[at[:, 0], at[:, 1]]  # slot 0's: the target's at the anchor
            copies.add(
                out["proposed"][:, 0], truth, recent_tokens(batch.draft_input, at, copies.window)
            )
    tau, greedy = stats.tau, stats.tau_greedy
    result = {
        # None when no held-out block is supervised in every slot (very short responses)
        "tau_sim": None if math.isnan(tau) else round(tau, 4),
        "pos_accept": stats.pos_accept,
        "loss": round(sum(losses) / max(1, len(losses)), 5),
        "blocks": stats.blocks,
    }
    if stats.measured_greedy:  # batches built by collate know the target's greedy tokens
        result["tau_greedy"] = None if math.isnan(greedy) else round(greedy, 4)
        result["pos_greedy"] = stats.pos_greedy
        result["cond_greedy"] = stats.cond_greedy
    if stats.decode_steps:  # every candidate an anchor: greedy decoding walked over them
        result["tau_decode"] = round(stats.tau_decode, 4)
    if copies.blocks:
        result["copy"] = copies.summary()
    return result


HISTORY_KEYS = ("tau_decode", "tau_greedy", "tau_sim", "pos_greedy", "cond_greedy", "copy")


def slot_metrics(name: str, result: dict) -> dict[str, float | None]:
    """One held-out evaluation's per-slot greedy acceptance (marginal `eval_greedy_slot<k>`,
    conditional `eval_cond_slot<k>`) and copy rates, as flat metric names for the tracker."""
    out: dict[str, float | None] = {}
    for key, label in (("pos_greedy", "greedy"), ("cond_greedy", "cond")):
        for k, rate in enumerate(result.get(key) or []):
            out[f"{name}/eval_{label}_slot{k}"] = rate
    for key, rate in (result.get("copy") or {}).items():
        if key.startswith(("draft_", "target_", "excess_")):
            out[f"{name}/eval_copy_{key}"] = rate
    return out


SourceFactory = Callable[[list[int]], AbstractContextManager[Source]]


@dataclass
class Trainer:
    cfg: TrainConfig
    runs: list[DraftRun]
    head: TargetHead
    checkpoint_dir: Path
    fingerprint: str  # what the run depends on; a checkpoint with another is not resumed
    events: EventLog | None = None
    progress: bool = True
    step: int = 0
    tokens: int = 0
    data_wait_s: float = 0.0
    eval_s: float = 0.0
    loop_s: float = 0.0  # this loop's wall time, summed over resumed runs
    resumed_from: int | None = None
    ranks: Ranks | None = None  # data-parallel ranks sharing each batch; None: this process only
    stop: StopRequest | None = None  # once set, the loop checkpoints and raises Stopped
    # Held-out sample id -> its source (data.val_sources): the last evaluation is also
    # measured per source, each source's samples batched on their own.
    eval_sources: dict[int, str] | None = None

    @property
    def leader(self) -> bool:
        """The process that evaluates and writes checkpoints."""
        return self.ranks is None or self.ranks.leader

    def share(self, ids: list[int]) -> list[int]:
        """This process's samples of a planned batch."""
        return ids if self.ranks is None else self.ranks.share(ids)

    def fit(self, open_source: SourceFactory, train_ids: list[int], eval_ids: list[int]) -> dict:
        c = self.cfg
        plans = cut(
            [
                epoch_plan(train_ids, e, c.seed, c.batch_size, c.shuffle_window)
                for e in range(c.epochs)
            ],
            c.max_steps,
        )
        total = sum(len(p) for p in plans)
        eval_every = max(1, total // c.eval_points)
        epoch, start = self._resume()  # every rank loads the checkpoint rank 0 wrote
        if self.ranks is not None:
            for run in self.runs:
                run.data_parallel(self.ranks)
        eval_batches: list[Batch] | None = None
        by_source: dict[str, list[Batch]] = {}
        bar = progress_bar(
            total=total, initial=self.step, desc="train", unit="step", enabled=self.progress
        )
        self._t0 = time.perf_counter()
        self._loop_before = self.loop_s
        for e in range(epoch, len(plans)):
            plan = plans[e]
            first = start if e == epoch else 0
            need = [i for b in plan[first:] for i in self.share(b)]
            if eval_batches is None and self.leader:
                need = sorted(set(need) | set(eval_ids))
            with open_source(need) as source:
                if eval_batches is None:
                    held = source.take(eval_ids) if self.leader else []
                    eval_batches = self._eval_batches(held)
                    by_source = self._batches_by_source(held)
                    if self.step == 0:
                        self._evaluate(eval_batches, {})
                for b in range(first, len(plan)):
                    self._train_step(source.take(self.share(plan[b])), total)
                    if self.stop:  # whoever reads our output may be gone: a write could fail
                        bar.disable = True
                    bar.update(1)
                    if self.step % eval_every == 0 or self.step == total:
                        self._evaluate(eval_batches, by_source if self.step == total else {})
                    stopping = self.step < total and self._stop_agreed()
                    if stopping or self.step % c.checkpoint_every == 0 or self.step == total:
                        self._account(source)
                        nxt = (e, b + 1) if b + 1 < len(plan) else (e + 1, 0)
                        self.save_checkpoint(*nxt)
                    if stopping:
                        bar.close()
                        raise Stopped(
                            f"train: stopped at step {self.step} of {total}; the checkpoint in "
                            f"{self.checkpoint_dir} resumes it (run the stage again)",
                            self.stop.signum if self.stop else signal.SIGTERM,
                        )
                self._account(source)
        bar.close()
        self._account(None)
        return {
            "steps": self.step,
            "tokens": self.tokens,
            "resumed_from_step": self.resumed_from,
            "data_wait_s": round(self.data_wait_s, 2),
            "eval_s": round(self.eval_s, 2),
            "loop_wall_s": round(self.loop_s, 2),
            # The real consumer_stall_fraction: the share of the training loop spent waiting.
            "consumer_stall_fraction": (
                round(self.data_wait_s / self.loop_s, 4) if self.loop_s else None
            ),
        }

    def _stop_agreed(self) -> bool:
        """Whether to stop after this step. Every rank must stop at the same one, so a request
        on any rank counts for all (one small all-reduce per step)."""
        asked = bool(self.stop)
        if self.ranks is None:
            return asked
        return bool(self.ranks.sum(torch.tensor([float(asked)], dtype=torch.float64)) > 0)

    def _account(self, source: Source | None) -> None:
        """Move the source's new waiting time and the loop's wall time into the totals."""
        if source is not None:
            self.data_wait_s += source.wait_s
            source.wait_s = 0.0
        self.loop_s = self._loop_before + time.perf_counter() - self._t0

    def _eval_batches(self, samples: list[Sample]) -> list[Batch]:
        size = self.cfg.batch_size
        return [collate(samples[i : i + size], self.head) for i in range(0, len(samples), size)]

    def _batches_by_source(self, samples: list[Sample]) -> dict[str, list[Batch]]:
        if not self.eval_sources:
            return {}
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(self.eval_sources[s.sample_id], []).append(s)
        return {name: self._eval_batches(group) for name, group in sorted(groups.items())}

    def _train_step(self, samples: list[Sample], total: int) -> None:
        t0 = time.perf_counter()
        # A rank with no share of a short last batch still takes part in the step's
        # all-reduces, on a blank sample with nothing supervised: it adds nothing.
        batch = collate(samples or [self._blank()], self.head)
        settle(self.head.draft_ids.device)
        prep = time.perf_counter() - t0
        if self.step == 0:
            self._calibrate(batch, real=bool(samples))
        part, tokens = None, batch.tokens
        if self.ranks is not None:
            rows = anchor_candidates(batch).sum(1).tolist() if samples else []
            part = Part.gather(self.ranks, rows, batch.tokens if samples else 0)
            tokens = part.tokens
        logged: dict[str, float] = {}
        for run in self.runs:
            for k, v in run.step(batch, self.step, total, self.cfg.seed, prep, part).items():
                logged[f"{run.name}/{k}"] = v
        self.step += 1
        self.tokens += tokens
        if self.events:
            self.events.log(self.step, tokens=self.tokens, **logged)

    def _calibrate(self, batch: Batch, real: bool) -> None:
        """Drafts with a context scale measure it on the first global batch, before its step."""
        models = [r.model for r in self.runs if getattr(r.model.cfg, "context_scale", False)]
        if not models:
            return
        seen = torch.arange(batch.aux.shape[1], device=batch.aux.device) < batch.lengths[:, None]
        seen &= real  # a rank's blank stand-in adds nothing
        square_sum = (batch.aux.double().pow(2) * seen[..., None]).sum((0, 1))  # [L*H]
        sums = torch.cat((square_sum, seen.sum().double()[None]))
        if self.ranks is not None:
            sums = self.ranks.sum(sums)
        for model in models:
            model.calibrate_context(sums[:-1], float(sums[-1]))

    def _blank(self) -> Sample:
        cfg = self.runs[0].model.cfg
        n, h = len(cfg.aux_layers), cfg.layer.hidden_size
        mask = torch.zeros(2, dtype=torch.bool)
        return Sample(
            -1, torch.zeros(2, dtype=torch.int32), mask, torch.zeros(n, 2, h), torch.zeros(2, h)
        )

    def _evaluate(self, batches: list[Batch], by_source: dict[str, list[Batch]]) -> None:
        if not self.leader:
            return
        t0 = time.perf_counter()
        logged = {}
        for run in self.runs:
            result = run.evaluate(batches)
            for name, group in by_source.items():
                run.by_source[name] = part = run.measure(group)
                logged[f"{run.name}/eval_tau_sim/{name}"] = part["tau_sim"]
                logged[f"{run.name}/eval_tau_greedy/{name}"] = part.get("tau_greedy")
                logged[f"{run.name}/eval_tau_decode/{name}"] = part.get("tau_decode")
            greedy = result.get("tau_greedy")
            run.curve.append([round(run.wall_s, 3), self.tokens, result["tau_sim"], greedy])
            run.history.append(
                {
                    "step": self.step,
                    "tokens": self.tokens,
                    "wall_s": round(run.wall_s, 3),
                    **{k: result.get(k) for k in HISTORY_KEYS},
                }
            )
            logged.update(slot_metrics(run.name, result))
            logged[f"{run.name}/eval_tau_sim"] = result["tau_sim"]
            logged[f"{run.name}/eval_tau_greedy"] = greedy
            logged[f"{run.name}/eval_tau_decode"] = result.get("tau_decode")
            logged[f"{run.name}/eval_loss"] = result["loss"]
            # Beside it in the draft's run, so a chart can put held-out tau_sim against the
            # tokens trained on and the draft's own training seconds, not only the step.
            logged[f"{run.name}/eval_tokens"] = self.tokens
            logged[f"{run.name}/eval_wall_s"] = round(run.wall_s, 3)
        self.eval_s += time.perf_counter() - t0
        if self.events:
            self.events.log(self.step, tokens=self.tokens, **logged)

    # --- checkpoints ----------------------------------------------------------------------------

    @property
    def previous_checkpoint(self) -> Path:
        """The checkpoint before the newest, kept in case the newest is damaged on disk."""
        return self.checkpoint_dir.with_name(self.checkpoint_dir.name + ".previous")

    def save_checkpoint(self, epoch: int, batch: int) -> None:
        """Written whole under a temporary name, on the disk before it replaces the newest,
        which becomes the previous; state.json, written last, holds every other file's size
        and checksum."""
        if not self.leader:
            return
        needed = sum(
            t.numel() * t.element_size()
            for r in self.runs
            for t in (
                *r.model.state_dict().values(),
                *ckpt.optimizer_tensors(r.optimizer, r.names).values(),
            )
        )
        with (
            space_for(self.checkpoint_dir, needed),
            atomic_dir(
                self.checkpoint_dir, durable=True, keep_previous=self.previous_checkpoint
            ) as tmp,
        ):
            for run in self.runs:
                tensors = ckpt.host_tensors(run.model.state_dict())
                ckpt.save_tensors(tmp / f"{run.name}.safetensors", tensors)
                ckpt.save_optimizer(tmp / f"{run.name}.optim.safetensors", run.optimizer, run.names)
            files = ckpt.file_digests(tmp)
            write_json(
                tmp / STATE,
                {
                    "files": files,
                    "fingerprint": self.fingerprint,
                    "epoch": epoch,
                    "batch": batch,
                    "step": self.step,
                    "tokens": self.tokens,
                    "data_wait_s": self.data_wait_s,
                    "eval_s": self.eval_s,
                    "loop_s": self.loop_s,
                    "runs": {
                        r.name: {
                            "wall_s": r.wall_s,
                            "curve": r.curve,
                            "last_eval": r.last_eval,
                            "history": r.history,
                        }
                        for r in self.runs
                    },
                },
            )

    def _checkpoint_to_resume(self) -> tuple[Path, dict] | None:
        """The newest undamaged checkpoint of this run and its state, saying on one line when
        a damaged one is passed over; None: start over."""
        candidates = [self.checkpoint_dir, self.previous_checkpoint, old_name(self.checkpoint_dir)]
        damaged: list[str] = []
        for folder in candidates:
            if not (folder / STATE).is_file():
                if folder.is_dir() and any(folder.iterdir()):  # state.json goes in last
                    damaged.append(f"{folder / STATE}: missing")
                continue
            try:
                state = ckpt.read_state(folder)
                if not self._belongs(state):
                    continue  # another configuration's checkpoint: it is replaced
                ckpt.verify_files(folder, state.get("files", {}))
            except DataError as e:
                damaged.append(str(e))
                continue
            if damaged:
                log.warning(
                    "train: damaged checkpoint passed over (%s); resuming from %s at step %d",
                    "; ".join(damaged),
                    folder,
                    state["step"],
                )
            return folder, state
        if damaged:
            log.warning("train: no undamaged checkpoint (%s); starting over", "; ".join(damaged))
        return None

    def _belongs(self, state: dict) -> bool:
        names = {r.name for r in self.runs}
        return state.get("fingerprint") == self.fingerprint and set(state.get("runs", {})) == names

    def _resume(self) -> tuple[int, int]:
        """Load the newest undamaged checkpoint of this run; -> (epoch, batch) to continue at."""
        found = self._checkpoint_to_resume()
        if found is None:
            return 0, 0
        folder, state = found
        for run in self.runs:
            where = folder / f"{run.name}.safetensors"
            ckpt.load_state(run.model, ckpt.load_tensors(where), where)
            opt_path = folder / f"{run.name}.optim.safetensors"
            ckpt.load_optimizer(run.optimizer, run.names, ckpt.read_optimizer(opt_path), opt_path)
            saved = state["runs"][run.name]
            run.wall_s, run.curve, run.last_eval = (
                saved["wall_s"],
                saved["curve"],
                saved["last_eval"],
            )
            run.history = saved.get("history", [])  # checkpoints of older code have none
        self.step, self.tokens = state["step"], state["tokens"]
        self.data_wait_s, self.eval_s = state["data_wait_s"], state["eval_s"]
        self.loop_s = state["loop_s"]
        self.resumed_from = self.step
        return state["epoch"], state["batch"]


def fingerprint(*parts: object) -> str:
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
