"""What one optimizer step of each sweep point costs, measured side by side, so a study can
give every arm the same compute: an arm whose step costs twice the baseline's gets half its
steps (flows/sweep.py `--equal-compute`).

Every point's drafts are built as the train stage builds them and step in turn on the same
batches of the extract stage's shards, the first batch a warm-up. A point's cost is the median
of its timed steps: single steps stall for seconds now and then even on an idle machine (seen
on the full profile's data: 4.2 s in a run of 0.9 s steps), and a mean over a few steps let one
stall double a point's cost and halve its steps. The order the points step in rotates from batch
to batch, so none is always the first to meet a batch's new shapes. The figures are still
seconds: measure with nothing else running and say so beside them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from dspark.config import Params
from dspark.extract.capture import resolve_aux_layers
from dspark.models.target import load_target_for, set_threads
from dspark.train.batch import TargetHead, collate
from dspark.train.sources import HiddenShards, split_eval
from dspark.train.stage import TrainPaths, build_runs, starting_drafts


@dataclass(frozen=True)
class PointCost:
    seconds: dict[str, float]  # per draft: median seconds per optimizer step
    timed: dict[str, list[float]] | None = None  # per draft: every timed step, in batch order

    @property
    def step_s(self) -> float:
        """The point's step: its drafts train side by side, so their steps add up."""
        return sum(self.seconds.values())


def measure_step_costs(
    points: list[Params], paths: TrainPaths, batches: int = 4, threads: int | None = None
) -> list[PointCost]:
    """Seconds per optimizer step of every point's drafts, over `batches` batches of the
    training split (the first not counted); the points must share a target and extraction."""
    if batches < 2:
        raise ValueError("batches: at least 2 (the first one warms up)")
    base = points[0]
    set_threads(threads or base.train.threads)
    target = load_target_for(base.target, paths.target)
    aux = resolve_aux_layers(base.extract.aux_layers, target.num_layers)
    shards = HiddenShards(paths.hidden)
    train_ids, eval_ids = split_eval(shards.ids, base.train.eval_samples)
    size = base.train.batch_size
    if len(train_ids) < batches * size:
        raise ValueError(
            f"batches: {paths.hidden} has {len(train_ids)} training samples, fewer than "
            f"{batches} batches of {size}"
        )
    for p in points[1:]:  # one vocabulary and mask token for all: counted once
        for key in ("draft_vocab_size", "batch_size", "eval_samples"):
            if getattr(p.train, key) != getattr(base.train, key):
                raise ValueError(f"train.{key}: the points of a cost measure must share it")
        if p.train.dspark.mask_token_id != base.train.dspark.mask_token_id:
            raise ValueError("train.dspark.mask_token_id: the points must share it")
    start = starting_drafts(base, paths, target, set(eval_ids), aux)
    runs = [start.runs] + [
        build_runs(p, target, start.draft_ids, aux, start.mask_id) for p in points[1:]
    ]
    head = TargetHead(target.norm, target.lm_head, start.draft_ids)
    timed: list[dict[str, list[float]]] = [{r.name: [] for r in rs} for rs in runs]
    for i in range(batches):
        batch = collate(list(shards.read(train_ids[i * size : (i + 1) * size])), head)
        for p in rotation(len(runs), i):
            for run in runs[p]:
                t0 = time.perf_counter()
                run.step(batch, i, batches, base.train.seed, 0.0)
                if i:
                    timed[p][run.name].append(time.perf_counter() - t0)
    return [point_cost(t) for t in timed]


def rotation(points: int, batch: int) -> list[int]:
    """The order the points step in on `batch`: each one first in turn."""
    return [(batch + k) % points for k in range(points)]


def point_cost(timed: dict[str, list[float]]) -> PointCost:
    """A point's cost from its drafts' timed steps: the median, which a stalled step leaves be."""
    return PointCost({k: statistics.median(v) for k, v in timed.items()}, timed)


def equal_steps(costs: list[PointCost], baseline_steps: int) -> list[int]:
    """Each point's steps for the compute `baseline_steps` of the first point take."""
    budget = baseline_steps * costs[0].step_s
    return [max(1, round(budget / c.step_s)) for c in costs]
