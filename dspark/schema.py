"""What one training sample carries, in one place: extraction, transport and training import it.

Shape glossary:
    S  tokens in the sample (prompt + response)
    L  tapped aux layers (extract.aux_layers)
    H  target hidden size
    k  top-k logits kept per token (extract.topk_logits; absent when 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMA_VERSION = 1

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
    topk_values: torch.Tensor | None = None  # [S, k] wire dtype
    topk_indices: torch.Tensor | None = None  # [S, k] int32

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
        if (self.topk_values is None) != (self.topk_indices is None):
            raise SampleError("topk_values and topk_indices come together")
        if self.topk_values is not None:
            k = self.topk_values.shape[-1]
            _expect(self.topk_values, (s, k), self.aux_hidden.dtype, "topk_values")
            _expect(self.topk_indices, (s, k), torch.int32, "topk_indices")
        for name in ("aux_hidden", "last_hidden", "topk_values"):
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
        if self.topk_values is not None:
            out["topk_values"] = self.topk_values
            out["topk_indices"] = self.topk_indices
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
            topk_values=tensors.get("topk_values"),
            topk_indices=tensors.get("topk_indices"),
        ).validate()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    if tuple(t.shape) != shape:
        raise SampleError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise SampleError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def bytes_per_token(*, num_aux: int, hidden: int, wire_dtype: str, topk: int = 0) -> int:
    """Wire bytes per token for hidden-only (plus optional top-k) samples."""
    size = WIRE_DTYPES[wire_dtype].itemsize
    hidden_bytes = (num_aux + 1) * hidden * size
    return 4 + 1 + hidden_bytes + (topk * (size + 4) if topk else 0)
