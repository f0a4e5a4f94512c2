import pytest
import torch

from dspark.schema import Sample, SampleError, bytes_per_token


def make(s=5, h=8, layers=3, dtype=torch.bfloat16, k=0):
    kw = {}
    if k:  # positions 1..3 of 5 are followed by a response token
        kw = {
            "target_logprobs": torch.full((3, k), -1.0),
            "target_ids": torch.zeros(3, k, dtype=torch.int32),
        }
    return Sample(
        sample_id=7,
        input_ids=torch.arange(s, dtype=torch.int32),
        loss_mask=torch.tensor([False, False, True, True, True][:s]),
        aux_hidden=torch.randn(layers, s, h).to(dtype),
        last_hidden=torch.randn(s, h).to(dtype),
        **kw,
    )


def test_roundtrip_through_flat_tensors():
    for k in (0, 4):
        sample = make(k=k).validate()
        back = Sample.from_tensors(7, sample.tensors())
        assert all(
            torch.equal(a, b)
            for a, b in zip(sample.tensors().values(), back.tensors().values(), strict=True)
        )
        assert back.nbytes() == sample.nbytes()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input_ids": torch.zeros(5, dtype=torch.int64)}, "input_ids: expected dtype"),
        ({"loss_mask": torch.ones(4, dtype=torch.bool)}, "loss_mask: expected shape"),
        (
            {"aux_hidden": torch.zeros(3, 4, 8, dtype=torch.bfloat16)},
            r"aux_hidden: expected \[L, 5",
        ),
        ({"last_hidden": torch.zeros(5, 8)}, "last_hidden: expected dtype"),
        ({"last_hidden": torch.full((5, 8), float("nan"), dtype=torch.bfloat16)}, "non-finite"),
        ({"target_logprobs": torch.zeros(3, 2)}, "come together"),
        (  # one row per supervised position (3 here), not per token
            {"target_logprobs": torch.zeros(5, 2), "target_ids": torch.zeros(5, 2).int()},
            r"target_logprobs: expected shape \[3, 2\]",
        ),
        (
            {
                "target_logprobs": torch.zeros(3, 2).bfloat16(),
                "target_ids": torch.zeros(3, 2).int(),
            },
            "target_logprobs: expected dtype",
        ),
    ],
)
def test_schema_violations_are_typed_errors(change, message):
    fields = {**make().__dict__, **change}
    with pytest.raises(SampleError, match=message):
        Sample(**fields).validate()


def test_hidden_only_is_over_20x_smaller_than_full_logits_for_smollm2():
    hidden = bytes_per_token(num_aux=3, hidden=576, wire_dtype="bfloat16")
    full_logits = 49152 * 2
    assert full_logits / hidden > 20
