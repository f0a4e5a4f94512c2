"""What one training sample carries, in one place: extraction, transport and training import it.

Shape glossary:
    S  tokens in the sample (prompt + response)
    L  tapped aux layers (extract.aux_layers)
    H  target hidden size
    R  supervised positions: those whose next token is a response token (loss_mask[1:])
    k  the target's top-k next-token log-probabilities kept per supervised position
       (extract.target_topk; absent when 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# 2: the target's top-k are log-probabilities at the supervised positions only
SCHEMA_VERSION = 2

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SampleError(ValueError):
    """A sample that breaks the schema: wrong shape, dtype, or non-finite values."""


@dataclass(frozen=True)
class Sample:
    sample_id: int
    input_ids: torch.Tensor  # [S] int32
    loss_mask: torch.Tensor  # [S] bool, True on response tokens
    aux_hidden: torch.Tensor  # [L, S, H] wire dtype
    last_hidden: torch.Tensor  # [S, H] wire dtype: the frozen lm_head rebuilds target logits
    # The target's k most likely next tokens and their log-probabilities (normalized over the
    # whole vocabulary) at the R supervised positions, in order: the trainer's targets without
    # a full-vocabulary lm_head per position and epoch.
    target_logprobs: torch.Tensor | None = None  # [R, k] float32
    target_ids: torch.Tensor | None = None  # [R, k] int32

    @property
    def supervised(self) -> torch.Tensor:
        """[R] the positions t whose next token t+1 is a response token."""
        return self.loss_mask[1:].nonzero()[:, 0]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> Sample:
        """Check shapes, dtypes and finiteness; return self so it chains."""
        s = self.num_tokens
        _expect(self.input_ids, (s,), torch.int32, "input_ids")
        _expect(self.loss_mask, (s,), torch.bool, "loss_mask")
        if self.aux_hidden.dim() != 3 or self.aux_hidden.shape[1] != s:
            raise SampleError(
                f"aux_hidden: expected [L, {s}, H], got {list(self.aux_hidden.shape)}"
            )
        h = self.aux_hidden.shape[2]
        _expect(self.last_hidden, (s, h), self.aux_hidden.dtype, "last_hidden")
        if (self.target_logprobs is None) != (self.target_ids is None):
            raise SampleError("target_logprobs and target_ids come together")
        if self.target_logprobs is not None:
            r, k = int(self.loss_mask[1:].sum()), self.target_logprobs.shape[-1]
            _expect(self.target_logprobs, (r, k), torch.float32, "target_logprobs")
            _expect(self.target_ids, (r, k), torch.int32, "target_ids")
        for name in ("aux_hidden", "last_hidden", "target_logprobs"):
            t = getattr(self, name)
            if t is not None and not torch.isfinite(t).all():
                raise SampleError(f"sample {self.sample_id}: {name} has non-finite values")
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor, the form every transport moves."""
        out = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "aux_hidden": self.aux_hidden,
            "last_hidden": self.last_hidden,
        }
        if self.target_logprobs is not None:
            out["target_logprobs"] = self.target_logprobs
            out["target_ids"] = self.target_ids
        return out

    @classmethod
    def from_tensors(cls, sample_id: int, tensors: dict[str, torch.Tensor]) -> Sample:
        missing = {"input_ids", "loss_mask", "aux_hidden", "last_hidden"} - tensors.keys()
        if missing:
            raise SampleError(f"sample {sample_id}: missing tensors {sorted(missing)}")
        return cls(
            sample_id=sample_id,
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            aux_hidden=tensors["aux_hidden"],
            last_hidden=tensors["last_hidden"],
            target_logprobs=tensors.get("target_logprobs"),
            target_ids=tensors.get("target_ids"),
        ).validate()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    if tuple(t.shape) != shape:
        raise SampleError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise SampleError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def bytes_per_token(*, num_aux: int, hidden: int, wire_dtype: str, topk: int = 0) -> int:
    """Wire bytes per token for hidden-only samples, plus the target's top-k where asked (an
    upper bound: only supervised positions carry it)."""
    size = WIRE_DTYPES[wire_dtype].itemsize
    hidden_bytes = (num_aux + 1) * hidden * size
    return 4 + 1 + hidden_bytes + topk * (4 + 4)
