"""Where a block draft's slots look: each layer's attention mass, per slot, over the context
positions just before the block's anchor p and over the block itself.

    python -m evals.slot_attention [--root .] [--profile P] [--drafts dspark dflash]
                                   [--samples 16] [--anchors 48] [--out FILE]

Slot 0 holds the anchor token x_p and drafts x_{p+1}. EAGLE-3 drafts that token from x_p and
the target's feature of position p-1 carried in its residual stream; a block draft can reach
that feature only through attention. This measures how much it does: over the validation split
(`train.eval_samples`, the lowest sample ids) of the extract stage's hidden shards, every
response position p >= 9 can be an anchor (up to `--anchors` a sample, spread evenly over the
answer), and each slot's attention weights, averaged over heads, fall into buckets p-1, p-2,
p-3, p-8..p-4, earlier context and its own block. Each head's weight at p-1 is averaged over
the anchors too (`head_p1`); the table prints the head that looks at p-1 most, with its mean
logit at p-1 and at the strongest other context position. Next to the layer's logit scale
(what q_norm's and k_norm's gains allow; train.dspark.qk_norm_init), those say whether a head
is held back by how sharp it may be or by where it points.
Writes metrics/studies/slot_attention.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dspark.config import load_params
from dspark.drafts import load_draft
from dspark.errors import DataError
from dspark.metrics import write_metrics
from dspark.models.dspark import DSparkDraft
from dspark.models.target import load_target_for
from dspark.pipeline import DRAFTS, TARGET_DIR
from dspark.schema import Sample
from evals.heldout_decode import one_line_errors, validation_samples

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("p-1", "p-2", "p-3", "p-8..p-4", "earlier", "own block")
FIRST_ANCHOR = 9  # every bucket exists from here on


@torch.no_grad()
def slot_attention(model: DSparkDraft, samples: list[Sample], anchors_per_sample: int) -> dict:
    """-> {"anchors": n, "layers": [{"mass": [K][buckets], "head_p1": [K][heads], ...}, ...]}:
    each slot's mean attention per bucket (heads averaged), each head's mean weight at p-1, its
    mean logit there (`logit_p1`) and at its strongest rival in the context (`logit_rival`), and
    the layer's `logit_scale` (BlockAttention.logit_scale: how sharp its gains let it be)."""
    k, n_layers = model.cfg.block_size, model.cfg.num_layers
    heads = model.cfg.layer.num_heads
    mass = torch.zeros(n_layers, k, len(BUCKETS), dtype=torch.float64)
    head_p1 = torch.zeros(n_layers, k, heads, dtype=torch.float64)
    logit_p1 = torch.zeros(n_layers, k, heads, dtype=torch.float64)
    logit_rival = torch.zeros(n_layers, k, heads, dtype=torch.float64)
    count = 0
    for x in samples:
        ids = x.input_ids.long()
        s = ids.shape[0]
        start = max(int(x.loss_mask.int().argmax()), FIRST_ANCHOR)
        if start > s - 2:
            continue
        # Spread over the whole answer: attention's reach depends on how much context there is.
        n = min(anchors_per_sample, s - 1 - start)
        anchors = torch.linspace(start, s - 2, n).round().long().unique()
        aux = x.aux_hidden.float().permute(1, 0, 2).reshape(1, s, -1)  # [1, S, L*H]
        logits: list[torch.Tensor] = []
        model.backbone(model.context(aux), ids[anchors][None], anchors[None], attention=logits)
        a = anchors.numel()
        p = anchors[:, None]  # [A, 1]
        pos = torch.arange(s)[None, :]  # [1, S]
        near = (pos >= p - 8) & (pos < p - 3)
        buckets = [pos == p - 1, pos == p - 2, pos == p - 3, near, pos < p - 8]  # [A, S] each
        for li, z in enumerate(logits):
            z = z[0].view(z.shape[1], a, k, -1).double()  # [nh, A, K, S+A*K]
            w = z.softmax(dim=-1)
            ctx = w[..., :s]
            per_head = [(ctx * m[None, :, None, :]).sum(-1) for m in buckets]  # [nh, A, K]
            per_head.append(w[..., s:].sum(-1))  # its own block: other blocks are masked
            mass[li] += torch.stack(per_head, dim=-1).mean(0).sum(0)  # [K, buckets]
            head_p1[li] += per_head[BUCKETS.index("p-1")].sum(1).T  # [K, nh]
            at_p1 = buckets[0][None, :, None, :]  # [1, A, 1, S]
            # One position each: its logit (where, not a product: masked logits are -inf).
            logit_p1[li] += torch.where(at_p1, z[..., :s], 0.0).sum(-1).sum(1).T
            rivals = z[..., :s].masked_fill(at_p1, float("-inf"))  # earlier positions, -inf
            logit_rival[li] += rivals.amax(-1).sum(1).T  # p >= 9: a rival always exists
        count += a
    if not count:
        raise DataError(f"no anchor at position >= {FIRST_ANCHOR} in the samples")
    return {
        "anchors": count,
        "layers": [
            {
                "mass": _table(mass[li] / count),
                "head_p1": _table(head_p1[li] / count),
                "logit_p1": _table(logit_p1[li] / count),
                "logit_rival": _table(logit_rival[li] / count),
                "logit_scale": round(model.layers[li].self_attn.logit_scale(), 4),
            }
            for li in range(n_layers)
        ],
    }


def _table(rows: torch.Tensor) -> list[list[float]]:
    return [[round(float(v), 4) for v in row] for row in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the workspace the stages ran in")
    ap.add_argument("--profile", default=None, help="params.yaml profile (default: its own)")
    ap.add_argument("--drafts", nargs="*", default=["dspark", "dflash"])
    ap.add_argument("--samples", type=int, default=16, help="of the validation split")
    ap.add_argument("--anchors", type=int, default=48, help="anchors per sample")
    ap.add_argument("--out", type=Path, default=None)
    return one_line_errors(run, ap.parse_args(argv))


def run(args: argparse.Namespace) -> None:
    root = args.root
    for name in args.drafts:
        if not (root / DRAFTS / name / "config.json").is_file():
            raise DataError(f"{root / DRAFTS / name}: no trained draft (run the train stage)")
    params = load_params(root / "params.yaml", args.profile)
    target = load_target_for(params.target, root / TARGET_DIR)
    samples, _, _ = validation_samples(root, params, args.samples)
    doc = {}
    for name in args.drafts:
        model, _ = load_draft(root / DRAFTS / name, target.embed)
        if not isinstance(model, DSparkDraft):
            raise DataError(f"{name}: not a block draft (its slots are what this measures)")
        found = slot_attention(model.eval(), samples, args.anchors)
        doc[name] = found
        print(f"\n{name}: {found['anchors']} anchors, {len(samples)} held-out samples")
        for li, layer in enumerate(found["layers"]):
            print(f"\nlayer {li}: logit scale {layer['logit_scale']:.2f}")
            head = "best head at p-1 | its logit there, rival's"
            print("| slot | " + " | ".join(BUCKETS) + f" | {head} |")
            print("|---" * (len(BUCKETS) + 3) + "|")
            for slot, by_head in enumerate(layer["head_p1"]):
                top = max(range(len(by_head)), key=by_head.__getitem__)
                cells = " | ".join(f"{v:.3f}" for v in layer["mass"][slot])
                z1, z2 = layer["logit_p1"][slot][top], layer["logit_rival"][slot][top]
                print(
                    f"| {slot} | {cells} | {by_head[top]:.3f} (head {top}) | {z1:.2f}, {z2:.2f} |"
                )
    out = args.out or root / "metrics" / "studies" / "slot_attention.json"
    write_metrics(out, params.profile, {"samples": len(samples), "buckets": BUCKETS, **doc})
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
