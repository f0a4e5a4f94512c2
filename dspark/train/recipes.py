"""How each draft kind starts training: its model built from train.<kind> and the target, and
the objective that trains it. The draft registry (dspark.drafts) names one recipe per kind; the
train stage runs the recipes of the kinds train.drafts names (`build_runs`).

A recipe may start several drafts: DSpark's also starts the Markov-ablation variants
(train.markov_ablation). Each draft is seeded alike, so a draft's start does not depend on
which others train beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from dspark.config import MARKOV_ABLATION, OptimConfig, Params
from dspark.errors import ConfigError
from dspark.models.dflash import DFlashConfig, DFlashDraft
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.models.layers import LayerShape
from dspark.models.target import Target
from dspark.train.losses import LossWeights
from dspark.train.objectives import DSparkObjective, Eagle3Objective


@dataclass(frozen=True)
class Setup:
    """What every recipe builds from: the target and what the stage chose for all drafts."""

    params: Params
    target: Target
    shape: LayerShape  # the target's layer shape, each draft layer's unless widened
    # The target's embedding, on `device`; the drafts borrow it outside their module tree.
    embed: nn.Embedding
    rows: torch.Tensor  # [d, H] the target's lm_head rows of the draft vocabulary
    draft_ids: torch.Tensor  # [d] the draft vocabulary
    aux_layers: tuple[int, ...]  # the target layers whose outputs feed the drafts
    mask_id: int
    device: torch.device


@dataclass
class Recipe:
    """One draft as it starts training: its model, objective and optimizer settings."""

    name: str  # its folder among the trained drafts: its kind's name, or a variant's
    model: nn.Module
    objective: Callable  # (model, batch, generator) -> slot_losses' dict
    eval_objective: Callable
    optim: OptimConfig
    slots: int  # tokens drafted per step (block size or TTT depth)


Recipes = Callable[[Setup], list[Recipe]]


def widened(s: Setup, draft: str, kv_heads: int | None) -> LayerShape:
    """The target's layer shape with `kv_heads` key/value heads (train.<draft>.num_kv_heads)."""
    if kv_heads is None:
        return s.shape
    if s.shape.num_heads % kv_heads:
        raise ConfigError(
            f"train.{draft}.num_kv_heads: {kv_heads} does not divide the target's "
            f"{s.shape.num_heads} attention heads"
        )
    return replace(s.shape, num_kv_heads=kv_heads)


def block_fields(s: Setup) -> dict:
    """What the block drafts share, from train.dspark: DSpark over DFlash then measures the
    heads alone."""
    d = s.params.train.dspark
    return dict(
        layer=widened(s, "dspark", d.num_kv_heads),
        block_size=d.block_size,
        aux_layers=s.aux_layers,
        vocab_size=s.target.vocab_size,
        draft_vocab_size=int(s.draft_ids.numel()),
        mask_token_id=s.mask_id,
        context_scale=d.context_scale,
        sample_from_anchor=d.sample_from_anchor,
        block_attention=d.block_attention,
        feature_input=d.feature_input,
    )


def block_draft(
    s: Setup,
    model_cls: type[DSparkDraft],
    cfg: DSparkConfig,
    output_scale: float,
    qk: float,
    train_lm_head: bool = False,
) -> DSparkDraft:
    """A DSpark or DFlash draft as it starts: seeded, its final norm the target's times
    `output_scale`, its q/k norm gains at `qk`, its lm_head rows trained or frozen, on the
    stage's device."""
    if train_lm_head and cfg.draft_vocab_size == cfg.vocab_size:
        raise ConfigError(
            "train_lm_head: needs train.draft_vocab_size below the target's vocabulary (a "
            "full-vocabulary export leaves the head out and takes the verifier's own)"
        )
    torch.manual_seed(s.params.train.seed)
    model = model_cls(cfg, s.embed, s.rows)
    with torch.no_grad():
        model.norm.weight.copy_(s.target.norm.weight * output_scale)
    model.set_qk_gain(qk)
    model.lm_head.requires_grad_(train_lm_head)
    return model.to(s.device)


def dspark_recipes(s: Setup) -> list[Recipe]:
    """DSpark, and with train.markov_ablation its variants beside it."""
    d = s.params.train.dspark
    block = block_fields(s)
    heads = dict(
        markov_rank=d.markov_rank, markov_head=d.markov_head, confidence_head=d.confidence_head
    )
    weights = LossWeights(
        ce=d.ce_weight,
        tv=d.tv_weight,
        kl=d.kl_weight,
        gamma=d.gamma,
        confidence=d.confidence_weight,
    )
    variants = {"dspark": {}, **(MARKOV_ABLATION if s.params.train.markov_ablation else {})}
    out = []
    for name, changes in variants.items():
        own = {**heads, **changes}
        # Without a Markov head the confidence head has no Markov input to see.
        with_markov = d.confidence_with_markov and own["markov_rank"] > 0
        cfg = DSparkConfig(
            num_layers=d.num_layers, **block, **own, confidence_with_markov=with_markov
        )
        model = block_draft(s, DSparkDraft, cfg, d.output_scale, d.qk_norm_init, d.train_lm_head)
        objective = DSparkObjective(weights, d.max_anchors)
        out.append(
            Recipe(name, model, objective, DSparkObjective(weights, None), d.optim, cfg.draft_slots)
        )
    return out


def dflash_recipes(s: Setup) -> list[Recipe]:
    """DFlash: DSpark's block without the heads, trained on its authors' loss, CE alone,
    unless a sweep adds the KL lever."""
    d, f = s.params.train.dspark, s.params.train.dflash
    block = block_fields(s)
    if f.num_kv_heads:
        block["layer"] = widened(s, "dflash", f.num_kv_heads)
    for lever in ("sample_from_anchor", "block_attention", "feature_input"):
        if getattr(f, lever) is not None:  # the study's levers DFlash sets apart from DSpark's
            block[lever] = getattr(f, lever)
    cfg = DFlashConfig(num_layers=f.num_layers or d.num_layers, **block)
    train_head = d.train_lm_head if f.train_lm_head is None else f.train_lm_head
    qk = f.qk_norm_init or d.qk_norm_init
    model = block_draft(s, DFlashDraft, cfg, f.output_scale, qk, train_head)
    weights = LossWeights(ce=1.0, tv=0.0, kl=f.kl_weight, gamma=f.gamma)
    objective = DSparkObjective(weights, f.max_anchors or d.max_anchors)
    eval_objective = DSparkObjective(weights, None)
    return [Recipe("dflash", model, objective, eval_objective, f.optim, cfg.draft_slots)]


def eagle3_recipes(s: Setup) -> list[Recipe]:
    """EAGLE-3 over the target's own layer shape, its norm and lm_head rows the target's."""
    d, e = s.params.train.dspark, s.params.train.eagle3
    cfg = Eagle3Config(
        layer=s.shape,
        num_aux=len(s.aux_layers),
        aux_layers=s.aux_layers,
        vocab_size=s.target.vocab_size,
        draft_vocab_size=int(s.draft_ids.numel()),
        ttt_steps=e.ttt_steps or d.block_size,
    )
    torch.manual_seed(s.params.train.seed)
    model = Eagle3Draft(cfg, s.embed)
    model.init_from_target(s.target.norm, s.target.lm_head, s.draft_ids)
    with torch.no_grad():
        model.norm.weight.mul_(e.output_scale)
    model.lm_head.requires_grad_(False)  # frozen, as speculators and DSpark keep it
    model.to(s.device)
    weights = LossWeights(ce=0.0, tv=0.0, kl=1.0, gamma=None, decay=e.loss_decay)
    objective = Eagle3Objective(weights, e.max_anchors)
    return [Recipe("eagle3", model, objective, Eagle3Objective(weights), e.optim, cfg.ttt_steps)]
