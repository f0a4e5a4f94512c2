"""transformers' greedy `generate` of the target: the reference our decoder must reproduce token
for token (evaluate's lossless check) and the baseline it is timed against (evaluate, bench).

A divergence where the target's top-2 logits differ by less than `TIE` is a tie (float noise
between two forwards can flip it); any other divergence is a mismatch.
"""

from __future__ import annotations

import time

import torch

from dspark.models.target import Target

TIE = 1e-4


class Reference:
    """transformers' greedy generate of the target, and the tie test at a divergence."""

    def __init__(self, target: Target):
        self.target = target

    def generate(self, ids: list[int], max_new: int) -> tuple[list[int], float]:
        """The greedy continuation of `ids` (static cache) and the seconds it took."""
        rows, seconds = self.generate_batch([ids], max_new)
        return rows[0], seconds

    @torch.no_grad()
    def generate_batch(
        self, prompts: list[list[int]], max_new: int
    ) -> tuple[list[list[int]], float]:
        """The greedy continuation of each prompt, generated together (left-padded, static
        cache), and the seconds the batch took. A row ends at its first EOS, as it would alone:
        generate pads a finished row with EOS while the others go on."""
        eos = self.target.eos_token_id
        width = max(len(p) for p in prompts)
        x = torch.full((len(prompts), width), eos, dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, p in enumerate(prompts):
            x[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        out = self.target.model.generate(
            input_ids=x,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            cache_implementation="static",
        )
        seconds = time.perf_counter() - t0
        rows = []
        for row in out[:, width:].tolist():
            rows.append(row[: row.index(eos) + 1] if eos in row else row)
        return rows, seconds

    @torch.no_grad()
    def compare(self, ids: list[int], want: list[int], got: list[int]) -> str:
        """'same', 'tie' or 'mismatch'."""
        if got == want:
            return "same"
        at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        if at is None:  # one is a prefix of the other: a stop differs, not a token
            return "mismatch"
        logits = self.target.model(input_ids=torch.tensor([ids + want[:at]])).logits[0, -1]
        # A tie: the token we chose is within TIE of the target's best (so the two top tokens
        # are that close); any other choice is a real divergence.
        return "tie" if float(logits.max() - logits[got[at]]) < TIE else "mismatch"
