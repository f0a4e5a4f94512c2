"""Fixtures of the decoding tests: a tiny target whose greedy output varies, our Llama of it,
prompts, and transformers' greedy generate of them (the reference every decoder must match)."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from dspark.decode.llama import Llama

NEW = 24  # tokens generated per prompt


@pytest.fixture(scope="session")
def varied(tiny_target):
    """The tiny target with larger random weights: its greedy output varies token to token
    (the session's tiny target mostly repeats one token, which any draft would guess)."""
    model = copy.deepcopy(tiny_target.model)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" not in name:
            nn.init.normal_(p, std=0.2)
    return dataclasses.replace(tiny_target, model=model)


@pytest.fixture(scope="session")
def llama(varied):
    return Llama.from_hf(varied.model)


@pytest.fixture(scope="session")
def prompts(varied):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, varied.vocab_size, (n,), generator=gen).tolist() for n in (9, 17, 4)]


@pytest.fixture(scope="session")
def reference(varied, prompts):
    """transformers' greedy generate, one prompt at a time, stopped at EOS or NEW tokens."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = varied.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=varied.eos_token_id,
                pad_token_id=varied.eos_token_id,
            )
        out.append(gen[0, len(p) :].tolist())
    return out
