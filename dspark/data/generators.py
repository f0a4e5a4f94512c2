"""The prepare stage's generators, by name (the params key `prepare.engine` picks one).

A generator opens as a context manager yielding `generate(prompts, *, max_new_tokens, sampling,
seed) -> responses` with the contract of `generate.generate_batch`: one response of token ids per
prompt, in order, ending at (and including) EOS if reached.

    hf    transformers' generate on the loaded target, in this process
    vllm  vLLM's server from its own venv (`make vllm-venv`), started on the first call (a rerun
          whose shards are all finished never starts it) and stopped when the stage ends
    extract  answers nothing here: a sample without a response is a prompt the extract stage's
          producers answer, keeping the hidden states as they decode (dspark.extract.onpolicy),
          so the target runs over those tokens once, not twice
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dspark.config import SamplingConfig


class GenerateFn(Protocol):
    def __call__(
        self, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingConfig, seed: int
    ) -> list[list[int]]: ...


@dataclass(frozen=True)
class GeneratorSetup:
    target: object  # the loaded Target (hf generates with it)
    target_dir: Path  # the provision stage's folder (vllm serves it)
    max_len: int  # prompt + response tokens a request can need
    batch: int  # prompts generated together
    venv: Path | None = None  # vllm's venv (default: .venv-vllm under the working directory)
    log: Path | None = None  # vllm's server log (default: a temporary file)


GENERATORS: dict[str, Callable[[GeneratorSetup], AbstractContextManager[GenerateFn]]] = {}


def register(name: str):
    def add(fn):
        if name in GENERATORS:
            raise ValueError(f"generator {name!r} is registered twice")
        GENERATORS[name] = contextmanager(fn)
        return fn

    return add


def open_generator(name: str, setup: GeneratorSetup) -> AbstractContextManager[GenerateFn]:
    try:
        return GENERATORS[name](setup)
    except KeyError:
        known = ", ".join(sorted(GENERATORS))
        raise ValueError(f"prepare.engine: unknown generator {name!r} (known: {known})") from None


@register("hf")
def _hf(setup: GeneratorSetup) -> Iterator[GenerateFn]:
    from dspark.data.generate import generate_batch

    yield functools.partial(generate_batch, setup.target)


@register("extract")
def _left_to_extract(setup: GeneratorSetup) -> Iterator[GenerateFn]:
    def generate(prompts, *, max_new_tokens, sampling, seed):
        return [[] for _ in prompts]

    yield generate


@register("vllm")
def _vllm(setup: GeneratorSetup) -> Iterator[GenerateFn]:
    from dspark.servers.vllm_server import VllmServer

    server = VllmServer(
        setup.target_dir,
        venv=setup.venv,
        max_model_len=setup.max_len,
        max_num_seqs=setup.batch,
        log=setup.log,
    )

    def generate(prompts, *, max_new_tokens, sampling: SamplingConfig, seed):
        if server.proc is None:
            server.start().wait_ready()
        if sampling.greedy:
            return server.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        return server.generate(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=seed,
        )

    try:
        yield generate
    finally:
        server.stop()
