"""Batched response generation with the target (on-policy training data)."""

from __future__ import annotations

import torch

from dspark.config import SamplingConfig
from dspark.models.target import Target


@torch.inference_mode()
def generate_batch(
    target: Target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
) -> list[list[int]]:
    """Responses for a batch of tokenized prompts, each ending at (and including) EOS if reached.

    Prompts are left-padded so every row's next token sits at the same position.
    """
    pad = target.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, S]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, S]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        attention[row, width - len(p) :] = 1
    gen_kwargs = {"do_sample": False}
    if not sampling.greedy:
        gen_kwargs = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": 0,
        }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = target.model.generate(
            input_ids=ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            eos_token_id=target.eos_token_id,
            pad_token_id=pad,
            **gen_kwargs,
        )  # [B, S + new]
    responses = []
    for row in out[:, width:].tolist():
        if target.eos_token_id in row:
            row = row[: row.index(target.eos_token_id) + 1]
        responses.append(row)
    return responses
