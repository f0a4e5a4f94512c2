"""Run inside the speculators venv (it cannot import dspark): load an exported DSpark or DFlash
folder with speculators' own DSparkDraftModel or DFlashDraftModel (by the folder's
speculators_model_type) and write its logits for the given inputs.

    python load_export.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds input_ids [1, T], aux [1, T, n*H] and anchors [N] (sorted, none in the last
block_size positions). speculators picks its anchors at random among the loss-masked positions,
so the loss mask is set exactly at the anchors and max_anchors to their count: then its anchors
are ours. Its forward returns only a loss, so the logits are assembled from the same pieces its
forward uses (_backbone_forward, then the Markov bias and the confidence head).

The export names its verifier by public hub id where the target has one; speculators would fetch
that from the hub. Offline, the verifier is loaded from the local copy the export records under
our own key (`dspark.verifier_local_path`), as a user with the weights on disk would point it.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

KINDS = {
    "dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
    "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
}


def main(folder: str, inputs: str, out: str) -> None:
    x = load_file(inputs)
    doc = json.loads((Path(folder) / "config.json").read_text())
    config_cls, model_cls = KINDS[doc["speculators_model_type"]]
    cfg = config_cls.from_pretrained(folder)
    cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    local = doc.get("dspark", {})
    if local.get("verifier_local_path"):
        cfg.speculators_config.verifier.name_or_path = local["verifier_local_path"]
    model = model_cls.from_pretrained(folder, config=cfg).eval()
    ids, aux, anchors = x["input_ids"], x["aux"], x["anchors"]
    t = ids.shape[1]
    n, b = anchors.numel(), model.block_size
    loss_mask = torch.zeros(1, t, dtype=torch.long)
    loss_mask[0, anchors] = 1
    with torch.no_grad():
        hidden, logits, _, _, idx = model._backbone_forward(
            aux,
            ids,
            loss_mask,
            torch.zeros(1, t, aux.shape[-1] // len(cfg.aux_hidden_state_layer_ids)),
            torch.zeros(1, t, dtype=torch.long),
            max_anchors=n,
        )
        assert torch.equal(idx.view(n, b)[:, 0], anchors), "speculators picked other anchors"
        prev = ids[0, idx].view(n, b)
        hidden = hidden.view(n, b, -1)
        logits = logits.view(n, b, -1)
        tensors = {"logits": logits}
        if getattr(model, "markov_head", None) is not None:
            emb = model.markov_head.prev_embeddings(prev)
            logits = logits + model.markov_head.block_bias(
                prev_token_ids=prev, hidden_states=hidden, prev_emb=emb
            )
            tensors["logits"] = logits
        if getattr(model, "confidence_head", None) is not None:
            feats = hidden
            if cfg.confidence_head_with_markov:
                feats = torch.cat([hidden, model.markov_head.prev_embeddings(prev)], dim=-1)
            tensors["confidence"] = model.confidence_head(feats)
    tensors["d2t"] = model.d2t if model.d2t is not None else torch.zeros(0, dtype=torch.long)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
