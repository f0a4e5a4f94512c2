"""From streamed samples to what both drafts train on: padded tensors plus the target's own
next-token distribution over the draft vocabulary.

A sample that carries the target's top-k (extract.target_topk) gives it directly and the batch
keeps it sparse: the k tokens' draft indices and probabilities, exact but for the mass beyond the
k (which then counts as mass no draft can match). Memory and the loss's work then grow with k,
not with the draft vocabulary. Otherwise the distribution is rebuilt, dense over the draft
vocabulary, with the frozen final norm and lm_head from the last layer's hidden states: a
full-vocabulary matmul per supervised position and epoch.

Shape glossary: B samples, S padded length, L aux layers, H hidden, d draft vocabulary, k kept
target tokens per position (k = d when dense).
Position t's target distribution is the target's prediction of token t+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.schema import Sample


@dataclass
class Batch:
    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, S] int64, 0-padded
    lengths: torch.Tensor  # [B]
    aux: torch.Tensor  # [B, S, L*H] float32: the aux layers' hidden states, concatenated
    valid: torch.Tensor  # [B, S] bool: token t+1 exists and is a response (loss-masked) token
    labels: torch.Tensor  # [B, S] int64: argmax of p_target at t (a draft index), -1 unused
    p_target: torch.Tensor  # [B, S, k] float32: target probabilities of draft tokens at t
    # [B, S, k] int64: which draft tokens p_target holds (0 with probability 0 pads a position
    # whose k best leave the draft vocabulary); None: p_target is dense, every d in order.
    p_ids: torch.Tensor | None = None
    # [B, S] int64: the target's own greedy choice at t over its whole vocabulary, as a draft
    # index; -1 where it lies outside the draft vocabulary (no draft can propose it) or t is
    # unsupervised. Unlike `labels`, never the best of the draft tokens when the target's is
    # not one. None: not known (a batch built by hand).
    greedy: torch.Tensor | None = None
    # [B, S] int64: each input token as a draft index, -1 outside the draft vocabulary or in
    # padding (what a draft could copy from its input: train/diagnostics.py). None: not known.
    draft_input: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def dense_p(self, d: int) -> torch.Tensor:
        """[B, S, d] the target probabilities over the whole draft vocabulary."""
        if self.p_ids is None:
            return self.p_target
        out = torch.zeros(*self.p_target.shape[:2], d, device=self.p_target.device)
        return out.scatter_add_(-1, self.p_ids, self.p_target)


class TargetHead(nn.Module):
    """The target's frozen final norm and lm_head, restricted to the draft vocabulary on output."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, draft_ids: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.register_buffer("draft_ids", draft_ids.to(torch.int64), persistent=False)
        index = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.int64)
        index[draft_ids.to(torch.int64)] = torch.arange(draft_ids.numel())
        self.register_buffer("draft_index", index, persistent=False)  # [V]: -1 outside
        self.requires_grad_(False)

    @torch.no_grad()
    def probs(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] pre-norm last-layer states -> [T, d] target probabilities of the draft tokens."""
        return self.probs_and_greedy(last_hidden)[0]

    @torch.no_grad()
    def probs_and_greedy(self, last_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] pre-norm last-layer states -> [T, d] target probabilities of the draft tokens,
        and [T] the draft index of the target's greedy token (-1 outside the draft vocabulary)."""
        w = self.lm_head.weight
        logits = self.lm_head(self.norm(last_hidden.to(w.dtype)).to(w.dtype)).float()  # [T, V]
        return torch.softmax(logits, dim=-1)[:, self.draft_ids], self.draft_index[logits.argmax(-1)]

    @torch.no_grad()
    def greedy_from_topk(self, logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The target's top-k, log-probs [T, k] and token ids [T, k] -> [T] the draft index of
        its most likely token (-1 outside the draft vocabulary)."""
        best = ids.gather(-1, logprobs.argmax(-1, keepdim=True))[:, 0]
        return self.draft_index[best.to(self.draft_index.device, torch.int64)]

    @torch.no_grad()
    def sparse_from_topk(
        self, logprobs: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k, log-probs [T, k] and token ids [T, k] -> probabilities [T, k] and
        draft indices [T, k], the tokens outside the draft vocabulary as index 0 with 0."""
        where = self.draft_index[ids.to(self.draft_index.device, torch.int64)]  # [T, k]
        mass = torch.where(where >= 0, logprobs.to(where.device).exp(), 0.0)
        return mass, where.clamp_min(0)

    @torch.no_grad()
    def probs_from_topk(self, logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The target's top-k, log-probs [T, k] and token ids [T, k] -> [T, d] probabilities of
        the draft tokens (0 for those outside the k)."""
        mass, where = self.sparse_from_topk(logprobs, ids)
        out = torch.zeros(ids.shape[0], self.draft_ids.numel(), device=where.device)
        # The k ids are distinct, so only the padding (index 0, adding 0) can collide.
        return out.scatter_add_(1, where, mass)


def collate(samples: list[Sample], head: TargetHead) -> Batch:
    """Pad, concatenate aux layers, and attach the target's distributions where supervised:
    sparse when every sample carries its top-k, else dense. The batch is built where the head
    lives: where the drafts train."""
    dev = head.draft_ids.device
    b = len(samples)
    s = max(x.num_tokens for x in samples)
    num_aux, _, h = samples[0].aux_hidden.shape
    sparse = all(x.target_logprobs is not None for x in samples)
    k = max(x.target_ids.shape[1] for x in samples) if sparse else head.draft_ids.numel()
    input_ids = torch.zeros(b, s, dtype=torch.int64, device=dev)
    aux = torch.zeros(b, s, num_aux * h, device=dev)
    valid = torch.zeros(b, s, dtype=torch.bool, device=dev)
    labels = torch.full((b, s), -1, dtype=torch.int64, device=dev)
    greedy = torch.full((b, s), -1, dtype=torch.int64, device=dev)
    p_target = torch.zeros(b, s, k, device=dev)
    p_ids = torch.zeros(b, s, k, dtype=torch.int64, device=dev) if sparse else None
    for i, x in enumerate(samples):
        n = x.num_tokens
        input_ids[i, :n] = x.input_ids.to(dev, torch.int64)
        aux[i, :n] = x.aux_hidden.to(dev, torch.float32).permute(1, 0, 2).reshape(n, num_aux * h)
        valid[i, : n - 1] = x.loss_mask[1:].to(dev)
        where = valid[i].nonzero()[:, 0]  # only supervised positions need the lm_head
        if not where.numel():
            continue
        if sparse:  # R = the sample's supervised positions = `where`
            probs, ids = head.sparse_from_topk(x.target_logprobs, x.target_ids)  # [R, k_x]
            width = probs.shape[1]
            p_target[i, where, :width], p_ids[i, where, :width] = probs, ids
            best = probs.argmax(-1, keepdim=True)
            label = ids.gather(-1, best)[:, 0]
            greedy[i, where] = head.greedy_from_topk(x.target_logprobs, x.target_ids)
        elif x.target_logprobs is not None:
            probs = head.probs_from_topk(x.target_logprobs, x.target_ids)
            p_target[i, where] = probs
            label = probs.argmax(-1)
            greedy[i, where] = head.greedy_from_topk(x.target_logprobs, x.target_ids)
        else:
            probs, greedy[i, where] = head.probs_and_greedy(x.last_hidden.to(dev)[where])
            p_target[i, where] = probs
            label = probs.argmax(-1)
        # No draft token among the k: nothing to take the argmax of.
        labels[i, where] = torch.where(probs.amax(-1) > 0, label, -1)
    return Batch(
        sample_ids=[x.sample_id for x in samples],
        input_ids=input_ids,
        lengths=torch.tensor([x.num_tokens for x in samples]),
        aux=aux,
        valid=valid,
        labels=labels,
        p_target=p_target,
        p_ids=p_ids,
        greedy=greedy,
        draft_input=head.draft_index[input_ids],
    )
