import pytest
import torch

from dspark.data.shards import TokenSample
from dspark.errors import ConfigError
from dspark.extract.capture import HiddenStateCapture, default_aux_layers, resolve_aux_layers


def token_sample(n=12):
    ids = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[5:] = True
    return TokenSample(3, "p", ids.to(torch.int32), mask)


def test_default_layers():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(2) == [0, 1]
    with pytest.raises(ConfigError, match="layer 30 is out of range for a 30-layer target"):
        resolve_aux_layers([2, 30], 30)


def test_last_hidden_rebuilds_the_target_logits(tiny_target):
    capture = HiddenStateCapture(tiny_target, [0, 1], "float32", topk=4)
    try:
        sample = capture(token_sample())
    finally:
        capture.close()
    ids = sample.input_ids.to(torch.long)[None]
    with torch.inference_mode():
        out = tiny_target.model(input_ids=ids, output_hidden_states=True)
    rebuilt = tiny_target.lm_head(tiny_target.norm(sample.last_hidden))
    torch.testing.assert_close(rebuilt, out.logits[0], rtol=1e-5, atol=1e-5)
    # aux layer i is decoder layer i's output (hidden_states[0] is the embedding)
    torch.testing.assert_close(sample.aux_hidden[0], out.hidden_states[1][0])
    assert sample.aux_hidden.shape == (2, 12, 64) and sample.loss_mask.sum() == 7
    # The top-k sit at the supervised positions (4..10: token t+1 is a response token) and are
    # log-probabilities over the whole vocabulary, most likely first.
    want = torch.log_softmax(out.logits[0, 4:11], dim=-1).topk(4, dim=-1)
    assert sample.target_logprobs.shape == (7, 4) and sample.target_ids.dtype == torch.int32
    torch.testing.assert_close(sample.target_logprobs, want.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(sample.target_ids.long(), want.indices)


def test_wire_dtype_and_hooks_removed(tiny_target):
    layers = tiny_target.model.model.layers
    before = [len(layer._forward_hooks) for layer in layers]  # transformers keeps its own
    capture = HiddenStateCapture(tiny_target, [1], "bfloat16")
    sample = capture(token_sample())
    capture.close()
    assert sample.aux_hidden.dtype == torch.bfloat16 and sample.target_logprobs is None
    assert [len(layer._forward_hooks) for layer in layers] == before
