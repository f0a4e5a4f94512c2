"""Export the trained block drafts in the speculators format (what speculators' DSparkDraftModel
and DFlash model and vLLM's speculators loader read), and import such a folder back. Which kinds
export, and as which architecture, is the draft registry's (`DraftKind.export`).

Field names and semantics follow speculators 0.9.0 (`DSparkSpeculatorConfig`, its DFlash base
`DFlashSpeculatorConfig`, and `DraftVocabMixin`); a DFlash folder is a DSpark one without the
Markov and confidence fields, under its own type and architecture. Both layouts export:
every slot drafting (`sample_from_anchor: true`, DeepSpec's DFlash, our default) and
anchor-as-bonus (`false`, train.dspark.sample_from_anchor: false), the layout vLLM 0.32's DFlash
proposer is written for:
    aux_hidden_state_layer_ids  index into HF `hidden_states` (0 = embeddings), so our layer i
                                (the output of decoder layer i) is id i+1
    sample_from_anchor          true: every slot of a block drafts (block_size tokens per step);
                                false: slot 0 holds the verified token (block_size - 1)
    sliding_window_non_causal   true for our bidirectional block (vLLM reads it as the causality
                                of every layer: vllm_non_causal)
    t2d / d2t                   bool mask over the target vocabulary / int64 offsets with
                                target_id = draft_index + d2t[draft_index]; only when reduced
    lm_head.weight              the target's rows, saved only when the vocabulary is reduced
    embed_tokens                never saved: loaded from `speculators_config.verifier`
The block is bidirectional, so every layer is declared `full_attention`.
Weight names are the model's own: export is a copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dspark.drafts import DRAFT_KINDS, DraftKind, load_draft
from dspark.errors import DataError
from dspark.io import atomic_dir, ensure_writable_dir, write_json
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.layers import LayerShape
from dspark.train.checkpoint import load_state, load_tensors, read_json, save_tensors

# Our own metadata in config.json (speculators keeps unknown keys; vLLM ignores them):
# {"verifier_local_path": the target folder the draft was trained and exported against,
#  "extensions": the study's levers speculators' format has no field for, where set}.
DSPARK_KEY = "dspark"
# Levers with no speculators field, and the value that means the plain architecture. A draft
# with any other value carries them under DSPARK_KEY; speculators and vLLM would run it as the
# plain architecture, so it is for our decoder only (and `feature_fc.weight` is a tensor they
# do not know).
EXTENSIONS = {"block_attention": "bidirectional", "feature_input": "none"}
SPECULATORS_VERSION = "0.9.0"  # the release whose format this matches (and that the test loads)
# What speculators 0.9.0 reads for a key its DSpark config.json omits (DSparkSpeculatorConfig and
# its DFlash base). They are speculators' defaults, not ours (train.dspark): an import must mean
# what speculators would, even where the two disagree. tests/speculators checks them.
SPECULATORS_DEFAULTS = {
    "dspark": {
        "block_size": 8,
        "draft_vocab_size": 32000,
        "sample_from_anchor": True,
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    },
    "dflash": {"block_size": 8, "draft_vocab_size": 32000, "sample_from_anchor": False},
}


def export_kinds() -> dict[str, DraftKind]:
    """speculators' type (our kind's name) -> the draft kind, for every kind the registry
    gives an architecture in that format (`DraftKind.export`)."""
    return {kind.name: kind for kind in DRAFT_KINDS.values() if kind.export}


def speculators_config(
    cfg: DSparkConfig,
    verifier_config: dict,
    verifier_path: str,
    dtype: str = "float32",
    verifier_local_path: str | None = None,
) -> dict:
    """config.json for a DSpark or DFlash draft of `cfg` over the verifier whose config.json
    is given.

    `verifier_path` is what speculators and `vllm serve FOLDER` load the verifier from (a public
    hub id where the target has one); `verifier_local_path`, the copy this run used, goes under
    our own key, DSPARK_KEY, which both ignore."""
    layer_cfg = {
        k: v
        for k, v in verifier_config.items()
        if k
        not in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype")
    }
    layer_cfg.update(
        num_hidden_layers=cfg.num_layers,
        num_key_value_heads=cfg.layer.num_kv_heads,  # a sweep may widen the draft's
        layer_types=["full_attention"] * cfg.num_layers,
        tie_word_embeddings=False,
    )
    heads = (
        {
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_with_markov,
        }
        if cfg.kind == "dspark"
        else {}
    )
    return {
        "architectures": [DRAFT_KINDS.get(cfg.kind).export],
        "speculators_model_type": cfg.kind,
        "speculators_version": SPECULATORS_VERSION,
        "dtype": dtype,
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layers],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": vllm_non_causal(cfg),
        "sample_from_anchor": cfg.sample_from_anchor,
        **heads,
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": cfg.kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.draft_slots,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_path,
                "architectures": verifier_config.get("architectures", []),
            },
        },
        **({DSPARK_KEY: ours} if (ours := own_metadata(cfg, verifier_local_path)) else {}),
    }


def vllm_non_causal(cfg: DSparkConfig) -> bool:
    """`sliding_window_non_causal` for a draft of `cfg`: true unless its block is causal.

    speculators 0.9.0 reads the field for sliding-window layers only (full-attention layers,
    ours, are bidirectional whatever it says), but vLLM 0.32 makes it the causality of every
    DFlash layer (transformers_utils/configs/speculators/algos.py, update_dflash:
    `dflash_config["causal"] = not sliding_window_non_causal`). speculators' own default,
    false, thus has vLLM run a bidirectional block causally, which its CPU server was measured
    to do (docs/export.md). True means the same to speculators and the truth to vLLM; a block
    trained causal (the `block_attention` lever) says false, so vLLM runs it as trained."""
    return cfg.block_attention != "causal"


def own_metadata(cfg: DSparkConfig, verifier_local_path: str | None) -> dict:
    """What goes under DSPARK_KEY: the local verifier and the levers set off their plain value."""
    ours: dict = {}
    if verifier_local_path:
        ours["verifier_local_path"] = verifier_local_path
    extensions = {k: getattr(cfg, k) for k, plain in EXTENSIONS.items() if getattr(cfg, k) != plain}
    if extensions:
        ours["extensions"] = extensions
    return ours


def export_speculators(
    model: DSparkDraft,
    draft_ids: torch.Tensor,
    out_dir: Path,
    *,
    verifier_config: dict,
    verifier_path: str,
    verifier_local_path: str | None = None,
) -> dict:
    """Write `out_dir` (config.json + model.safetensors) atomically; return the config."""
    cfg = model.cfg
    doc = speculators_config(
        cfg, verifier_config, verifier_path, verifier_local_path=verifier_local_path
    )
    tensors = {k: v.detach().contiguous() for k, v in model.folded_state().items()}
    reduced = cfg.draft_vocab_size != cfg.vocab_size
    if reduced:
        d2t = draft_ids.to(torch.int64) - torch.arange(cfg.draft_vocab_size)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors.update(d2t=d2t.contiguous(), t2d=t2d)
    else:
        tensors.pop("lm_head.weight")  # the verifier's own head: loaded from it
    with atomic_dir(out_dir) as tmp:
        save_tensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        write_json(tmp / "config.json", doc)
    return doc


def import_speculators(folder: Path, embed: torch.nn.Embedding, lm_head: torch.nn.Module):
    """A speculators DSpark or DFlash folder -> (our draft, draft_ids), exactly as exported."""
    folder = Path(folder)
    doc = read_json(folder / "config.json")
    where = folder / "config.json"
    kind = doc.get("speculators_model_type")
    kinds = export_kinds()
    if kind not in kinds:
        raise DataError(f"{where}: speculators_model_type is not one of {', '.join(kinds)}")
    config_cls, model_cls = kinds[kind].config, kinds[kind].model
    # A kind speculators does not know has no defaults there: its export writes every key.
    doc = {**SPECULATORS_DEFAULTS.get(kind, {}), **doc}
    extensions = (doc.get(DSPARK_KEY) or {}).get("extensions") or {}
    unknown = sorted(set(extensions) - set(EXTENSIONS))
    if unknown:
        raise DataError(f"{where}: {DSPARK_KEY}.extensions: unknown {', '.join(unknown)}")
    try:
        layer_cfg = doc["transformer_layer_config"]
        shape = LayerShape.from_hf(layer_cfg)
        vocab = int(layer_cfg["vocab_size"])
        heads = (
            {
                "markov_rank": int(doc["markov_rank"]),
                "markov_head": doc["markov_head_type"],
                "confidence_head": bool(doc["enable_confidence_head"]),
                "confidence_with_markov": bool(doc["confidence_head_with_markov"]),
            }
            if kind == "dspark"
            else {}
        )
        cfg = config_cls(
            layer=shape,
            num_layers=int(layer_cfg["num_hidden_layers"]),
            block_size=int(doc["block_size"]),
            aux_layers=tuple(int(i) - 1 for i in doc["aux_hidden_state_layer_ids"]),
            vocab_size=vocab,
            draft_vocab_size=int(doc["draft_vocab_size"]),
            mask_token_id=int(doc["mask_token_id"]),
            sample_from_anchor=bool(doc["sample_from_anchor"]),
            **heads,
            **extensions,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: malformed speculators config ({e})") from None
    if embed.weight.shape != (cfg.vocab_size, shape.hidden_size):
        raise DataError(
            f"{where}: draft for vocab {cfg.vocab_size} x hidden {shape.hidden_size}, target "
            f"embedding is {list(embed.weight.shape)}"
        )
    tensors = load_tensors(folder / "model.safetensors")
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    if cfg.draft_vocab_size != cfg.vocab_size:
        if d2t is None or "lm_head.weight" not in tensors:
            raise DataError(f"{folder}: a reduced vocabulary needs d2t and lm_head.weight")
        draft_ids = torch.arange(cfg.draft_vocab_size) + d2t
    else:
        draft_ids = torch.arange(cfg.vocab_size)
        tensors["lm_head.weight"] = lm_head.weight.detach().clone()
    try:
        model = model_cls(cfg, embed, tensors["lm_head.weight"])
    except ValueError as e:  # a combination the model refuses
        raise DataError(f"{where}: {e}") from None
    load_state(model, tensors, folder / "model.safetensors")
    return model, draft_ids


def roundtrip_diff(a: DSparkDraft, b: DSparkDraft, seed: int = 0) -> float:
    """Max |logit difference| of two drafts on one random sequence with every slot drafting."""
    cfg = a.cfg
    gen = torch.Generator().manual_seed(seed)
    s = 4 * cfg.block_size
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=gen)
    aux = torch.randn(1, s, len(cfg.aux_layers) * cfg.layer.hidden_size, generator=gen)
    anchors = torch.arange(1, s - cfg.block_size, 3)[None]
    with torch.no_grad():
        la, ca = a.forward_train(ids, aux, anchors)
        lb, cb = b.forward_train(ids, aux, anchors)  # [N, K, d], [N, K]
    diff = (la - lb).abs().max()
    if ca is not None:
        diff = torch.maximum(diff, (ca - cb).abs().max())
    return float(diff)


def verifier_names(
    info: dict, target_dir: Path, override: str | None = None
) -> tuple[str, str | None]:
    """(what the export names as its verifier, the local copy or None) for the target whose
    manifest (target.json) is `info`. The name is its public hub id where it has one, so a GPU
    box serves the folder as is (`vllm serve FOLDER` loads the verifier by it); the local copy
    this run used is kept under our own key."""
    from dspark.models.target import public_id

    kind = info.get("kind")
    local = info.get("path") if kind == "folder" else None
    if kind not in ("folder", "hub"):  # materialized into target_dir (gguf-package, tiny-random)
        local = str(Path(target_dir).resolve())
    return override or public_id(info) or local or str(Path(target_dir).resolve()), local


def export_stage(params, *, drafts_dir: Path, target_dir: Path, out_dir: Path) -> dict:
    """The export stage: each draft the profile trains whose kind exports (the block drafts,
    DSpark and DFlash) as a speculators folder `out_dir/<kind>`, re-imported and checked
    against the original. The metrics' top level is DSpark's; another kind's sit under its
    name. A profile that trains none of them exports nothing (EAGLE-3 has no speculators
    folder here)."""
    from dspark.models.target import load_target_for, read_manifest

    target = load_target_for(params.target, target_dir)
    info = read_manifest(target_dir)
    verifier, local = verifier_names(info, target_dir, params.export.verifier_name_or_path)
    kinds = [k for k in export_kinds() if k in params.train.drafts]
    out_dir = ensure_writable_dir(Path(out_dir))
    for old in out_dir.iterdir():  # a folder of a draft this profile no longer trains
        if old.name in kinds:
            continue
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    result: dict = {
        "format": params.export.format,
        "speculators_version": SPECULATORS_VERSION,
        "verifier": verifier,
        "verifier_local_path": local,
    }
    for kind in kinds:
        model, draft_ids = load_draft(Path(drafts_dir) / kind, target.embed)
        folder = out_dir / kind
        doc = export_speculators(
            model,
            draft_ids,
            folder,
            verifier_config=target.model.config.to_dict(),
            verifier_path=verifier,
            verifier_local_path=local,
        )
        back, back_ids = import_speculators(folder, target.embed, target.lm_head)
        checked = {
            "draft_vocab_size": doc["draft_vocab_size"],
            "speculative_tokens": back.cfg.draft_slots,
            "bytes": sum(f.stat().st_size for f in folder.iterdir()),
            "roundtrip_vocab_equal": bool(torch.equal(back_ids, draft_ids)),
            "roundtrip_max_abs_diff": roundtrip_diff(model, back),
        }
        if kind == "dspark":
            result.update(checked)
        else:
            result[kind] = checked
    return result
