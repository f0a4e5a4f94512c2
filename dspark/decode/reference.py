"""transformers' greedy `generate` of the target: the reference our decoder must reproduce token
for token and the baseline it is timed against (bench); and the same check teacher-forced
(`check_batch`: one forward per prompt instead of a generate), evaluate's lossless check.

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
    def check_batch(
        self, prompts: list[list[int]], paths: list[list[int]]
    ) -> list[list[tuple[int, float]]]:
        """Each greedy path checked against transformers, teacher-forced (a path is
        transformers' greedy output exactly when, at every step, its next token is transformers'
        choice given the path so far) -> per row, (offset in the path, margin) wherever it is
        not: margin is transformers' top logit minus the path token's, so below `TIE` it is a
        tie. One forward per row: a padded batch would pay for every row at the longest width."""
        out = []
        for prompt, path in zip(prompts, paths, strict=True):
            ids = torch.tensor([prompt + path])
            keep = len(path) + 1
            logits = self.target.model(input_ids=ids, logits_to_keep=keep).logits[0, :-1]
            want = torch.tensor(path, dtype=torch.long)  # logits row j chose path token j
            margin = logits.max(-1).values - logits.gather(-1, want[:, None])[:, 0]
            off = torch.nonzero(logits.argmax(-1) != want).flatten().tolist()
            out.append([(j, round(float(margin[j]), 6)) for j in off])
        return out

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
