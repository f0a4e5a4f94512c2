"""Capture the target's hidden states for one token sequence.

Forward hooks on the decoder layers pick up each tapped layer's output; the last layer's output
is kept before the final norm, so the frozen `lm_head(norm(h))` rebuilds the target's logits on
the training side. With `topk`, the target's k most likely next tokens and their log-probabilities
are kept too, at the supervised positions only: the trainer's targets then cost an index
lookup, not a full-vocabulary lm_head per position and epoch. Only the backbone runs here (no
lm_head) unless they are asked for and were not already computed (the on-policy decoder hands in
its own).
"""

from __future__ import annotations

import torch

from dspark.data.shards import TokenSample
from dspark.errors import ConfigError
from dspark.models.target import Target
from dspark.schema import WIRE_DTYPES, Sample


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default [2, L//2, L-3]; clamped and deduplicated for very shallow targets."""
    picks = (2, num_layers // 2, num_layers - 3)
    return sorted({min(max(p, 0), num_layers - 1) for p in picks})


def resolve_aux_layers(layers: list[int] | None, num_layers: int) -> list[int]:
    if layers is None:
        return default_aux_layers(num_layers)
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise ConfigError(
            f"extract.aux_layers: layer {bad[0]} is out of range for a {num_layers}-layer target"
        )
    if len(set(layers)) != len(layers):
        raise ConfigError("extract.aux_layers: a layer is listed twice")
    return list(layers)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logits -> the k most likely tokens' log-probabilities [N, k] float32 (normalized
    over all V) and their ids [N, k] int32, most likely first."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return values.contiguous(), ids.to(torch.int32).contiguous()


class HiddenStateCapture:
    """Callable: TokenSample -> Sample (schema-checked, in the wire dtype)."""

    def __init__(self, target: Target, aux_layers: list[int], wire_dtype: str, topk: int = 0):
        self.target = target
        self.aux_layers = aux_layers
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.topk = topk
        self._taps = sorted({*aux_layers, target.num_layers - 1})
        self._seen: dict[int, torch.Tensor] = {}
        layers = target.model.model.layers
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self._taps]

    def _hook(self, index: int):
        def keep(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._seen[index] = hidden

        return keep

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @torch.inference_mode()
    def __call__(self, token_sample: TokenSample) -> Sample:
        ids = token_sample.input_ids.to(torch.long)[None]  # [1, S]
        self._seen.clear()
        self.target.model.model(input_ids=ids, use_cache=False)
        return self.package(
            token_sample.sample_id,
            token_sample.input_ids,
            token_sample.loss_mask,
            {i: self._seen[i][0] for i in self._taps},
        )

    @torch.inference_mode()
    def package(
        self,
        sample_id: int,
        input_ids: torch.Tensor,  # [S]
        loss_mask: torch.Tensor,  # [S]
        states: dict[int, torch.Tensor],  # {layer: [S, H]} for the aux layers and the last
        target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,  # [R, k] each, if known
    ) -> Sample:
        """The Sample of these tokens' states, however they were computed (a forward here, or
        our decoder as it decoded them, which also hands in the top-k it chose tokens from)."""
        aux = torch.stack([states[i] for i in self.aux_layers])  # [L, S, H]
        last = states[self.target.num_layers - 1]  # [S, H], before the final norm
        if self.topk and target_topk is None:
            where = loss_mask[1:].nonzero()[:, 0]  # the supervised positions
            logits = self.target.lm_head(self.target.norm(last[where]))  # [R, V]
            target_topk = topk_logprobs(logits, self.topk)
        logprobs, ids = target_topk if self.topk else (None, None)
        return Sample(
            sample_id=sample_id,
            input_ids=input_ids.to(torch.int32),
            loss_mask=loss_mask.to(torch.bool),
            aux_hidden=aux.to(self.wire_dtype).contiguous(),
            last_hidden=last.to(self.wire_dtype).contiguous(),
            target_logprobs=logprobs,
            target_ids=ids,
        ).validate()
