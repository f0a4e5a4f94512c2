"""The one registry of drafts and proposers. Whatever trains, loads or exports a draft or
builds a proposer by method name comes through here (train, evaluate, serve, lm-eval, export).

    draft kind  what a checkpoint's `model.kind` names: its config, model and proposer classes,
                the recipe that starts it training (train/recipes.py) and, for a block draft
                that exports in the speculators format, its architecture there
    method      what evaluate, serve and lm-eval ask for: `none`, `ngram`, one per draft kind
                (the trained folder `<drafts>/<kind>`), and `hybrid` (a suffix lookup beside
                the trained draft its config names) -> a builder of its proposer

Adding a draft kind is its module plus its `register_draft` call here, its name declared in
dspark.config (`declare_draft`, where params read it without importing torch). The train
stage's drafts, the export kinds, the params' choices and the CLI's all follow the registry.
Both tables refuse a second registration under a taken name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dspark.config import DRAFT_NAMES, HybridConfig, Params
from dspark.decode.drafters import DFlashProposer, DSparkProposer, Eagle3Proposer
from dspark.decode.hybrid import HybridProposer
from dspark.decode.proposers import NgramProposer, NoProposer, Proposer
from dspark.decode.suffix import SuffixProposer
from dspark.errors import ConfigError, DataError
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.models.layers import DraftConfig
from dspark.models.target import Target
from dspark.registry import Registry, UnknownName
from dspark.train.checkpoint import (
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    WEIGHTS,
    load_state,
    load_tensors,
    read_json,
)
from dspark.train.recipes import Recipes, dflash_recipes, dspark_recipes, eagle3_recipes

# --- draft kinds ----------------------------------------------------------------------------


# Builds a draft's module around the target's embedding from its config and saved tensors
# (before they are loaded into it): DSpark's constructor takes its frozen lm_head rows.
ModelBuilder = Callable[[DraftConfig, nn.Embedding, dict[str, torch.Tensor], Path], nn.Module]


@dataclass(frozen=True)
class DraftKind:
    config: type[DraftConfig]  # its `kind` is the name checkpoints carry
    model: type[nn.Module]
    proposer: Callable[[nn.Module, torch.Tensor], Proposer]  # (model, draft_ids)
    recipes: Recipes  # the drafts of this kind the train stage starts (train/recipes.py)
    build: ModelBuilder | None = None  # default: model(cfg, embed)
    # Its architecture in the speculators format (a block draft's: export.py); None: no export.
    export: str | None = None

    @property
    def name(self) -> str:
        return self.config.kind

    def build_model(self, cfg, embed, tensors, where: Path) -> nn.Module:
        return self.build(cfg, embed, tensors, where) if self.build else self.model(cfg, embed)


def block_model(cfg, embed, tensors, where: Path) -> DSparkDraft:
    """A block draft (DSpark, DFlash): the constructor takes the saved lm_head rows."""
    rows = tensors.get("lm_head.weight")
    if rows is None:
        raise DataError(f"{where}: lm_head.weight missing")
    return DRAFT_KINDS.get(cfg.kind).model(cfg, embed, rows)


@dataclass(frozen=True)
class ProposerContext:
    """What a method's builder may need; each caller fills it from its own params section."""

    target: Target
    drafts: Path  # the train stage's output: one folder per trained draft
    ngram_k: int  # tokens an n-gram proposer drafts per step
    ngram_window: tuple[int, int]  # its (min, max) match length
    hybrid: HybridConfig = field(default_factory=HybridConfig)  # the stage's own section's

    # n-gram drafts as many tokens as a DSpark block unless its section says otherwise.
    @classmethod
    def for_evaluate(cls, params: Params, target: Target, drafts: Path) -> ProposerContext:
        """evaluate.ngram's k, and its first window (vLLM's default; the stage sweeps all)."""
        ng = params.evaluate.ngram
        k = ng.k or params.train.dspark.block_size
        return cls(target, Path(drafts), k, tuple(ng.windows[0]), params.evaluate.hybrid)

    @classmethod
    def for_serve(cls, params: Params, target: Target, drafts: Path) -> ProposerContext:
        s = params.serve
        k = s.ngram_k or params.train.dspark.block_size
        return cls(target, Path(drafts), k, tuple(s.ngram_window), s.hybrid)


Builder = Callable[[ProposerContext], Proposer]

DRAFT_KINDS: Registry[DraftKind] = Registry("draft kind")
METHODS: Registry[Builder] = Registry("method")


def register_draft(kind: DraftKind) -> DraftKind:
    """A draft kind, and the method of the same name that loads its trained folder."""
    if kind.name not in DRAFT_NAMES.names():
        raise ValueError(
            f"draft kind {kind.name!r} is not declared in dspark.config (declare_draft), so "
            "params could not name it"
        )
    DRAFT_KINDS.register(kind.name, kind)
    METHODS.register(kind.name, lambda ctx: trained_proposer(ctx, kind.name))
    return kind


METHODS.register("none", lambda ctx: NoProposer())
METHODS.register(
    "ngram", lambda ctx: NgramProposer(ctx.ngram_k, *ctx.ngram_window, ctx.target.vocab_size)
)


def _hybrid(ctx: ProposerContext) -> HybridProposer:
    """The suffix lookup beside the trained draft the stage's `hybrid.draft` names, proposing as
    many tokens as the draft's block unless `hybrid.k` says otherwise."""
    h = ctx.hybrid
    draft = trained_proposer(ctx, h.draft)
    suffix = SuffixProposer(h.k or draft.k, h.max_match, ctx.target.vocab_size)
    return HybridProposer(draft, suffix, ctx.target.vocab_size)


# In dspark.config's order (DRAFT_NAMES), which is the order the train stage starts them in.
register_draft(
    DraftKind(
        DSparkConfig,
        DSparkDraft,
        DSparkProposer,
        recipes=dspark_recipes,
        build=block_model,
        export="DSparkSpeculator",
    )
)
register_draft(
    DraftKind(
        DFlashConfig,
        DFlashDraft,
        DFlashProposer,
        recipes=dflash_recipes,
        build=block_model,
        export="DFlashSpeculator",
    )
)
register_draft(DraftKind(Eagle3Config, Eagle3Draft, Eagle3Proposer, recipes=eagle3_recipes))
METHODS.register("hybrid", _hybrid)


# --- building and loading ---------------------------------------------------------------------


def build_proposer(method: str, ctx: ProposerContext) -> Proposer:
    try:
        builder = METHODS.get(method)
    except UnknownName as e:
        raise ConfigError(f"method: {e}") from None
    return builder(ctx)


def trained_proposer(ctx: ProposerContext, name: str) -> Proposer:
    """The trained draft `<drafts>/<name>` (a method's, or a Markov-ablation variant's)."""
    folder = ctx.drafts / name
    if not (folder / CONFIG).is_file():
        raise DataError(f"{folder}: no trained {name} draft (run the train stage)")
    return load_proposer(folder, ctx.target.embed)


def load_proposer(folder: Path, embed: nn.Embedding) -> Proposer:
    model, draft_ids = load_draft(folder, embed)
    return DRAFT_KINDS.get(model.cfg.kind).proposer(model, draft_ids)


def read_draft_config(folder: Path) -> DraftConfig:
    where = Path(folder) / CONFIG
    doc = read_json(where)
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} checkpoint")
    model = doc.get("model") or {}
    try:
        kind = DRAFT_KINDS.get(model.get("kind"))
    except UnknownName as e:
        raise DataError(f"{where}: model.kind: {e}") from None
    try:
        return kind.config.from_dict(model)
    except (TypeError, KeyError) as e:
        raise DataError(f"{where}: model: malformed ({e})") from None


def load_draft(folder: Path, embed: nn.Embedding) -> tuple[nn.Module, torch.Tensor]:
    """Rebuild a draft around the target's frozen embedding; check it fits that target."""
    folder = Path(folder)
    cfg = read_draft_config(folder)
    vocab, hidden = embed.weight.shape
    if cfg.vocab_size != vocab:
        raise DataError(
            f"{folder}: draft built for a {cfg.vocab_size}-token vocabulary, target has {vocab}"
        )
    if cfg.layer.hidden_size != hidden:
        raise DataError(f"{folder}: draft hidden size {cfg.layer.hidden_size}, target has {hidden}")
    tensors = load_tensors(folder / WEIGHTS)
    draft_ids = tensors.pop("draft_ids", None)
    if draft_ids is None or draft_ids.numel() != cfg.draft_vocab_size:
        raise DataError(f"{folder / WEIGHTS}: draft_ids missing or not {cfg.draft_vocab_size} long")
    model = DRAFT_KINDS.get(cfg.kind).build_model(cfg, embed, tensors, folder / WEIGHTS)
    load_state(model, tensors, folder / WEIGHTS)
    return model, draft_ids
