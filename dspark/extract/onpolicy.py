"""On-policy samples in one pass over the target: a producer answers prompts on our batched
decoder and keeps the tapped layers' hidden states as the tokens are made, so generating a
response and extracting its states are the same forward passes (the prepare stage's `extract`
generator leaves the answers to this).

Rows are continuously batched: a prompt takes a free row as soon as one frees, and a sample
leaves as soon as its row ends, so the batch stays full whatever the lengths. A row that ends
(EOS or max_new_tokens) runs one more plain step for the states of its last token, which the
extract stage's full forward has too; the token that step chooses is dropped.

Decoding is greedy, like the prepare stage's default: the same tokens as transformers' greedy
`generate`, up to float noise between a batched and a one-row forward. Row-invariant (the
default): a prompt's answer and states are bit for bit the same whatever shares its batch, so
two extractions of the same prompts agree however their producers were scheduled.

With `topk`, each position's top-k log-probabilities are taken from the very logits its next
token was chosen from (`LogitsTap`), so the trainer's targets cost the producer nothing more
than a log-softmax and a top-k per step.

Shape glossary: B rows, S positions of a sample, H hidden.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from dspark.decode.decoder import SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.replay import Recorder
from dspark.decode.sampling import GREEDY
from dspark.extract.capture import topk_logprobs


@dataclass
class Answered:
    key: Hashable  # whatever the caller admitted the prompt with
    input_ids: list[int]  # prompt + response (EOS included if reached)
    prompt_len: int
    feats: dict[int, torch.Tensor]  # {layer: [S, H]} outputs of the tapped layers
    # The target's top-k at the R supervised positions (prompt_len-1 onwards): log-probs
    # [R, k] float32 and ids [R, k] int32; None without `topk`.
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None


class LogitsTap:
    """The target's `Llama` for `SpecDecoder`, keeping the logits of its last call."""

    def __init__(self, llama: Llama):
        self.llama = llama
        self.logits: torch.Tensor | None = None  # [B, T, V] of the last call

    def new_cache(self, batch: int, slots: int):
        return self.llama.new_cache(batch, slots)

    def __call__(self, *args, **kwargs):
        self.logits, feats = self.llama(*args, **kwargs)
        return self.logits, feats

    def greedy(self, *args, **kwargs):
        logits, feats = self(*args, **kwargs)
        return logits.argmax(-1), feats


class OnPolicyDecoder:
    """`admit` prompts while `free` rows remain, `step` while `busy`; each step returns the
    samples whose rows ended."""

    def __init__(
        self,
        llama: Llama,
        eos_id: int,
        max_context: int,
        taps: tuple[int, ...],
        rows: int,
        max_prompt_tokens: int,
        max_new_tokens: int,
        topk: int = 0,
        row_invariant: bool = True,
    ):
        if max_prompt_tokens + max_new_tokens > max_context:
            raise ValueError(
                f"a prompt of {max_prompt_tokens} tokens + {max_new_tokens} new exceeds the "
                f"target's {max_context} positions"
            )
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.recorder = Recorder(taps)
        self.topk = topk
        # A row's answer and states must not depend on which prompts share its batch (or on
        # which producer took it): extraction reproduces (dspark/decode/llama.py). A copy, so
        # the caller's Llama keeps its own setting.
        llama = copy.copy(llama)
        llama.row_invariant = row_invariant
        self.tap = LogitsTap(llama)
        self.dec = SpecDecoder(self.tap if topk else llama, self.recorder, eos_id, max_context)
        # The dropped token after a row's last one is written one past it.
        self.rows = self.dec.new_rows(rows, max_prompt_tokens + max_new_tokens + 1)
        self.key: list[Hashable | None] = [None] * rows
        self.prompt_len = [0] * rows
        self.made = [0] * rows  # response tokens so far
        self.closing = [False] * rows  # the last token is in: one more step for its states
        self.kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(rows)]

    @property
    def free(self) -> list[int]:
        return [r for r in range(len(self.key)) if self.key[r] is None]

    @property
    def busy(self) -> bool:
        return any(k is not None for k in self.key)

    def admit(self, key: Hashable, prompt: list[int]) -> None:
        if not 0 < len(prompt) <= self.max_prompt_tokens:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens (1 to {self.max_prompt_tokens} fit a row)"
            )
        r = self.free[0]
        first = self.dec.admit(self.rows, r, prompt, GREEDY, None)
        self.key[r], self.prompt_len[r], self.made[r] = key, len(prompt), 1
        self.closing[r] = self._ends(first, 1)
        if self.topk:  # the prompt's last position chose the first response token
            values, ids = topk_logprobs(self.tap.logits[:, 0], self.topk)  # [1, k]
            self.kept[r] = [(values[0], ids[0])]

    def drop(self, wanted: Callable[[Hashable], bool]) -> int:
        """Free the rows whose key is no longer `wanted` (work nobody will take) -> how many."""
        gone = [r for r, k in enumerate(self.key) if k is not None and not wanted(k)]
        for r in gone:
            self.rows.active[r] = False
            self.key[r] = None
        return len(gone)

    def _ends(self, token: int, made: int) -> bool:
        return token == self.dec.eos_id or made >= self.max_new_tokens

    @torch.no_grad()
    def step(self) -> list[Answered]:
        rows = self.rows
        anchor = rows.n.clone()  # each row's last token: this step computes its states
        st = self.dec.step(rows, GREEDY, None, draft=False)
        top = topk_logprobs(self.tap.logits[:, 0], self.topk) if self.topk else None  # [B, k]
        done = []
        for r in torch.nonzero(st.count).flatten().tolist():
            if self.closing[r]:  # its last position predicts past the sample: nothing to keep
                length = int(anchor[r]) + 1
                feats = {i: f[r, :length].clone() for i, f in self.recorder.feats.items()}
                ids = rows.seq[r, :length].tolist()
                kept = None
                if top is not None:
                    values, tokens = zip(*self.kept[r], strict=True)
                    kept = (torch.stack(values), torch.stack(tokens))
                done.append(Answered(self.key[r], ids, self.prompt_len[r], feats, kept))
                rows.active[r] = False
                self.key[r] = None
                continue
            if top is not None:
                self.kept[r].append((top[0][r], top[1][r]))
            self.made[r] += 1
            self.closing[r] = self._ends(int(st.tokens[r, 0]), self.made[r])
        return done
