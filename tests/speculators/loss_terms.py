"""Run inside the speculators venv (it cannot import dspark): speculators' own per-position loss
terms and its decayed mean, for draft and target logits given in a file.

    python loss_terms.py IN.safetensors OUT.safetensors GAMMA

IN holds logits and targets [1, T, d] (T = blocks x block size, slot-major within a block) and
loss_mask [1, T]; OUT gets tv, kl, ce per position [1, T] and their decayed means (DSpark's
weighting: slot j of a block weighs exp(-j / GAMMA), its `sample_from_anchor`).
"""

import functools
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.losses.eager import ce_loss, kl_div_loss, tv_loss
from speculators.losses.utils import dflash_loss_decay
from speculators.models.dspark.metrics import _masked_decayed_mean


def main(inputs: str, out: str, gamma: float) -> None:
    x = load_file(inputs)
    logits, targets, mask = x["logits"], x["targets"], x["loss_mask"]
    block = int(x["block_size"][0])
    pos_idx = (torch.arange(logits.shape[1]) % block)[None]
    decay = functools.partial(dflash_loss_decay, gamma=gamma, sample_from_anchor=True)
    got = {}
    for name, fn in (("tv", tv_loss), ("kl", kl_div_loss), ("ce", ce_loss)):
        per = fn(logits, targets)
        got[name] = per.contiguous()
        got[f"{name}_mean"] = _masked_decayed_mean(per, mask, pos_idx, decay).reshape(1)
    save_file(got, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
