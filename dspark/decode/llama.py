"""The target's forward for speculative decoding, in the style of gpt-fast: a Llama that loads
the target's weights, keeps a static KV cache, and runs a batch of rows that each sit at their
own positions, so one call verifies a ragged batch of drafted tokens.

Every row writes its new keys and values at its own positions, then attends to its cache up to
each query's position. A padded token (`valid` False) writes into a scratch slot, the cache's
last, which no query ever reads, so padding never disturbs a row's cache. Tokens a verification
rejects need no undoing: the next call writes over those positions before anything reads them,
and a query never looks past its own position.

A ragged batch is packed: the projections and MLPs, which are most of the work, run only on the
valid tokens ([1, N, H]); only attention sees the padded [B, T] layout. So a verify step costs
what its real tokens cost, and a row that drafts nothing adds one token, not the batch's width.
A prefill of ragged rows, each from position 0, attends row by row on the causal kernel rather
than through one mask at the longest row's width.

Hidden states of any layer can be returned (`taps`, the output of decoder layer i, and the last
layer before the final norm), which is what the drafts read.

`row_invariant` makes every row's numbers independent of the rows beside it, so that the same
prompt gives the same answer and states whatever it is batched with (extraction's
reproducibility): every matrix multiply runs on at least MIN_ROWS tokens (padded), because
oneDNN/MKL take another kernel below that and a token's result changes in the last bits with
the batch (measured here, AVX-512 with AMX, on every weight shape of SmolLM2 and the tiny test
target at one thread, and on five of them at two: below 16 rows the results differ, from 16 up
to 128 they are the same; other CPUs may draw the line elsewhere, hence 32), and each row
attends alone, over exactly its own keys, where one batched call would pad every row to the
longest.

Shape glossary: B rows, T new tokens per row, M cache slots, H hidden, L layers, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.models.layers import (
    Attention,
    LayerShape,
    PreNormBlock,
    RMSNorm,
    apply_rope,
    gqa_attention,
    rope_cos_sin,
)


@dataclass
class KVCache:
    k: torch.Tensor  # [L, B, nkv, M, d]
    v: torch.Tensor

    @property
    def slots(self) -> int:
        return self.k.shape[3]

    @property
    def scratch(self) -> int:
        """Where padded tokens write; never attended to."""
        return self.slots - 1


# Tokens every matrix multiply of a row-invariant forward runs on, at least (see above).
MIN_ROWS = 32


@dataclass(frozen=True)
class Packing:
    """Where the N valid tokens of a [B, T] batch sit in it (flattened); `pad` zero tokens go
    after them (a row-invariant forward's minimum), and are dropped on unpacking."""

    index: torch.Tensor  # [N]
    rows: int
    width: int
    pad: int = 0

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, F] -> [1, N + pad, F]"""
        x = x.flatten(0, 1)[self.index]
        if self.pad:
            x = torch.cat((x, x.new_zeros(self.pad, x.shape[-1])))
        return x[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N + pad, F] -> [B, T, F], zeros at the padding."""
        out = x.new_zeros(self.rows * self.width, x.shape[-1])
        real = x[0, : self.index.numel()]
        return out.index_copy_(0, self.index, real).view(self.rows, self.width, -1)


@dataclass(frozen=True)
class RowLengths:
    """The mask of a ragged prefill: row r holds its first `lengths[r]` tokens at positions
    0..n-1 and padding after them."""

    lengths: list[int]


def causal_rows(q, k, v, lengths: list[int]) -> torch.Tensor:
    """A ragged prefill's attention, each row alone on SDPA's causal kernel over its own tokens
    -> [B, T, nh*d], zeros at the padding (packed out after). One explicit mask for the batch
    would attend every row over the longest row's width: 32 prompts of 50 to 1,500 tokens then
    cost what 32 of 1,500 do (evals/bench_prefill.py). q [B, nh, T, d]; k, v [B, nkv, T, d]."""
    b, nh, t, d = q.shape
    out = q.new_zeros(b, t, nh * d)
    for r, n in enumerate(lengths):
        out[r, :n] = gqa_attention(
            q[r : r + 1, :, :n], k[r : r + 1, :, :n], v[r : r + 1, :, :n], None
        )[0]
    return out


@dataclass(frozen=True)
class RowsAlone:
    """Each row attends alone: its valid queries over its own first slots up to each one's
    position (a row-invariant forward)."""

    positions: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]


def rows_alone(q, cache_k, cache_v, mask: RowsAlone) -> torch.Tensor:
    """q [B, nh, T, d]; cache_k/v [B, nkv, M, d] -> [B, T, nh*d], zeros at the padding. How a
    row attends depends on that row alone: a prefill from position 0 on the causal kernel, any
    other step through its own mask."""
    b, nh, t, d = q.shape
    out = q.new_zeros(b, t, nh * d)
    for r in range(b):
        at = torch.nonzero(mask.valid[r]).flatten()
        if not at.numel():
            continue
        pos = mask.positions[r, at]
        span = int(pos.max()) + 1
        keys, values = cache_k[r : r + 1, :, :span], cache_v[r : r + 1, :, :span]
        sees = None  # [T_r, span]; None: causal over positions 0..T_r-1
        if span != at.numel() or not bool((pos == torch.arange(span, device=q.device)).all()):
            sees = torch.arange(span, device=q.device)[None, :] <= pos[:, None]
        out[r, at] = gqa_attention(q[r : r + 1, :, at], keys, values, sees)[0]
    return out


class CachedAttention(Attention):
    """The drafts' attention projections, reading and writing the static cache."""

    def forward(self, x, rope, cache_k, cache_v, write_pos, mask, span, packing=None):
        """x [B, T, H] ([1, N, H] packed); cache_k/v [B, nkv, M, d] (this layer's, updated in
        place); write_pos [B, T]; mask [B, T, span]: which of the first `span` slots each
        query sees (None: causal, T == span; RowLengths: causal within each row's length)."""
        s = self.s
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if packing is not None:
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        b, t, _ = q.shape
        q = q.reshape(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = k.reshape(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.reshape(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        rows = torch.arange(b, device=x.device)[:, None]
        cache_k[rows, :, write_pos] = k.transpose(1, 2)  # [B, T, nkv, d] into slots
        cache_v[rows, :, write_pos] = v.transpose(1, 2)
        keys, values = cache_k[:, :, :span], cache_v[:, :, :span]
        if isinstance(mask, RowsAlone):
            out = rows_alone(q, cache_k, cache_v, mask)
        elif isinstance(mask, RowLengths):
            out = causal_rows(q, keys, values, mask.lengths)
        else:
            out = gqa_attention(q, keys, values, mask)  # [B, T, nh*d]
        return self.o_proj(out if packing is None else packing.pack(out))


class Llama(nn.Module):
    # A ragged prefill (rows of different lengths, each from position 0) attends row by row on
    # the causal kernel; False sends it through one explicit mask (the benchmark's baseline).
    ragged_causal = True

    def __init__(self, s: LayerShape, num_layers: int, vocab_size: int):
        super().__init__()
        self.s = s
        self.row_invariant = False  # see the module's docstring
        self.embed_tokens = nn.Embedding(vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(PreNormBlock(s, CachedAttention(s)) for _ in range(num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, vocab_size, bias=False)

    @classmethod
    def from_hf(cls, model: nn.Module) -> Llama:
        """A transformers Llama (the loaded target) -> ours, sharing nothing mutable."""
        cfg = model.config.to_dict()
        ours = cls(LayerShape.from_hf(cfg), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]))
        theirs = model.state_dict()
        state = {k.removeprefix("model."): v for k, v in theirs.items()}
        state.setdefault("lm_head.weight", theirs["model.embed_tokens.weight"])  # tied
        dtype = next(model.parameters()).dtype
        ours.load_state_dict(state)
        return ours.to(dtype).eval().requires_grad_(False)

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """A cache of `slots` positions per row (plus the scratch slot)."""
        s = self.s
        shape = (len(self.layers), batch, s.num_kv_heads, slots + 1, s.head_dim)
        w = self.embed_tokens.weight
        return KVCache(w.new_zeros(shape), w.new_zeros(shape))

    def greedy(self, tokens, positions, cache, valid=None, taps=()):
        """-> the greedy choice after every token [B, T], and the taps (as `forward`)."""
        logits, kept = self(tokens, positions, cache, valid, taps=taps)
        return logits.argmax(-1), kept

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64: where each token sits in its row
        cache: KVCache,
        valid: torch.Tensor | None = None,  # [B, T] bool: False for padding
        taps: tuple[int, ...] = (),
        logits: bool = True,
        logits_at: torch.Tensor | None = None,  # [B, n]: only these of the T tokens need them
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """-> logits [B, T, V] ([B, n, V] with `logits_at`; or the last layer's normed hidden
        state when `logits` is False), and {layer i: output of decoder layer i [B, T, H]} for
        `taps` (the last layer's is before the final norm). A long prefill needs `logits_at`:
        logits for every one of 8K positions would take gigabytes."""
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        last = int(torch.where(valid, positions, 0).max())
        if last >= cache.scratch:
            raise ValueError(f"position {last} is beyond the cache's {cache.scratch} slots")
        write_pos = torch.where(valid, positions, torch.full_like(positions, cache.scratch))
        span = last + 1  # no row reads past its last token
        slot = torch.arange(span, device=tokens.device)
        # Query at position p sees slots <= p; a padded query sees slot 0 (output unused).
        b, t = tokens.shape
        mask = None  # a prefill from position 0 of whole rows: the causal kernel, no mask
        from_zero = t == span and bool((positions == slot).all())
        if not (from_zero and bool(valid.all())):
            lengths = valid.sum(1)
            if (
                from_zero
                and self.ragged_causal
                and bool((valid == (slot < lengths[:, None])).all())
            ):
                mask = RowLengths(lengths.tolist())  # a ragged prefill: each row causal alone
            else:
                mask = (slot[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
                mask[..., 0] |= ~valid
        rope = rope_cos_sin(positions, self.s.head_dim, self.s.rope_theta)
        packing = None
        x = self.embed_tokens(tokens)
        if self.row_invariant:
            mask = RowsAlone(positions, valid)
            index = torch.nonzero(valid.flatten()).flatten()
            packing = Packing(index, b, t, pad=max(0, MIN_ROWS - index.numel()))
            x = packing.pack(x)
        elif not bool(valid.all()):
            index = torch.nonzero(valid.flatten()).flatten()
            packing = Packing(index, b, t)
            x = packing.pack(x)
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache.k[i], cache.v[i], write_pos, mask, span, packing)
            if i in taps:
                kept[i] = x if packing is None else packing.unpack(x)
        if logits_at is not None:
            if packing is not None:
                x = packing.unpack(x)
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
            packing = None
            if self.row_invariant:  # the lm_head's multiply on enough rows too
                n = x.shape[0] * x.shape[1]
                packing = Packing(torch.arange(n), x.shape[0], x.shape[1], max(0, MIN_ROWS - n))
                x = packing.pack(x)
        out = self.lm_head(self.norm(x)) if logits else self.norm(x)
        return (out if packing is None else packing.unpack(out)), kept
