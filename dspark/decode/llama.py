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
import torch.nn.functional as F
from torch import nn

from dspark.models.layers import (
    LayerShape,
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
    cost what 32 of 1,500 do (benchmarks/prefill.py). q [B, nh, T, d]; k, v [B, nkv, T, d]."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` of the drafts' layers op for op (the same bits), without the module call.
    torch 2.13's `F.rms_norm` gives the same bits but dispatches more aten calls on CPU (a
    1-token pass: 5,964 against 5,781, torch.profiler), so the formula stays written out."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class StepMask:
    """What every layer's attention of one forward needs, built once for all of them: which of
    the first `span` slots each query sees, laid out as the grouped SDPA call takes it
    ([B, 1, g*T, span]), or None when every query sees every slot (one new token per row,
    nothing padded)."""

    sdpa: torch.Tensor | None


LAYER_WEIGHTS = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{n}_proj.weight" for n in "qkvo"),
    *(f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
}


class TargetLayer(nn.Module):
    """One decoder layer of the target, its projections fused as the decoder runs them: q, k
    and v in one matrix, gate and up in another. A fused multiply's outputs are the same bits
    as the separate ones (MKL reduces each output column alone: checked here at 1 to 64 rows,
    AVX-512 with AMX); what it saves is the calls, which dominate a pass of a few tokens."""

    def __init__(self, s: LayerShape):
        super().__init__()
        self.s = s
        h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, h, bias=False)

    def load_hf(self, theirs: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy a transformers Llama layer's weights (`prefix` = 'model.layers.i.')."""
        w = {k.removeprefix(prefix): v for k, v in theirs.items() if k.startswith(prefix)}
        unknown = sorted(set(w) - LAYER_WEIGHTS)
        if unknown:  # a bias or a norm this layer lacks would otherwise be dropped silently
            raise ValueError(f"{prefix}{unknown[0]}: not a weight of the decoder's Llama layer")
        with torch.no_grad():
            self.input_norm.copy_(w["input_layernorm.weight"])
            self.post_norm.copy_(w["post_attention_layernorm.weight"])
            self.qkv.weight.copy_(
                torch.cat([w[f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")])
            )
            self.o_proj.weight.copy_(w["self_attn.o_proj.weight"])
            self.gate_up.weight.copy_(
                torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
            )
            self.down.weight.copy_(w["mlp.down_proj.weight"])

    def forward(self, x, rope, cache_k, cache_v, write, mask, span, packing=None):
        """x [B, T, H] ([1, N, H] packed); cache_k/v [B, nkv, M, d] (this layer's, updated in
        place); write: (rows [B, 1], slots [B, T]) where each token's key and value go; mask:
        a StepMask, None (causal, T == span), RowLengths or RowsAlone."""
        s = self.s
        eps = s.rms_norm_eps
        nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = self.qkv(rms_norm(x, self.input_norm, eps))
        if packing is not None:
            qkv = packing.unpack(qkv)
        b, t, _ = qkv.shape
        # q and k rotate together: one rope for both, the same bits as two.
        qk = qkv[..., : (nh + nkv) * d].reshape(b, t, nh + nkv, d).transpose(1, 2)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :nh], qk[:, nh:]  # [B, nh, T, d], [B, nkv, T, d]
        v = qkv[..., (nh + nkv) * d :].reshape(b, t, nkv, d)
        rows, slots = write
        cache_k[rows, :, slots] = k.transpose(1, 2)  # [B, T, nkv, d] into slots
        cache_v[rows, :, slots] = v
        if isinstance(mask, StepMask):
            out = _grouped_attention(q, cache_k[:, :, :span], cache_v[:, :, :span], mask.sdpa)
        elif isinstance(mask, RowsAlone):
            out = rows_alone(q, cache_k, cache_v, mask)
        elif isinstance(mask, RowLengths):
            out = causal_rows(q, cache_k[:, :, :span], cache_v[:, :, :span], mask.lengths)
        else:
            out = gqa_attention(q, cache_k[:, :, :span], cache_v[:, :, :span], None)
        x = x + self.o_proj(out if packing is None else packing.pack(out))
        gate, up = self.gate_up(rms_norm(x, self.post_norm, eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _grouped_attention(q, k, v, sdpa_mask) -> torch.Tensor:
    """`gqa_attention` with its mask already laid out for every layer: q [B, nh, T, d]; k, v
    [B, nkv, span, d]; sdpa_mask [B, 1, g*T, span] or None (every query sees every key)
    -> [B, T, nh*d]."""
    b, nh, t, d = q.shape
    nkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, nkv, nh // nkv * t, d), k, v, sdpa_mask)
    return out.reshape(b, nh, t, d).transpose(1, 2).reshape(b, t, nh * d)


class Llama(nn.Module):
    # A ragged prefill (rows of different lengths, each from position 0) attends row by row on
    # the causal kernel; False sends it through one explicit mask (the benchmark's baseline).
    ragged_causal = True

    def __init__(self, s: LayerShape, num_layers: int, vocab_size: int):
        super().__init__()
        self.s = s
        self.row_invariant = False  # see the module's docstring
        self.embed_tokens = nn.Embedding(vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(s) for _ in range(num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, vocab_size, bias=False)

    @classmethod
    def from_hf(cls, model: nn.Module) -> Llama:
        """A transformers Llama (the loaded target) -> ours, sharing nothing mutable."""
        cfg = model.config.to_dict()
        ours = cls(LayerShape.from_hf(cfg), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]))
        theirs = model.state_dict()
        dtype = next(model.parameters()).dtype
        ours.to(dtype).requires_grad_(False)
        with torch.no_grad():
            ours.embed_tokens.weight.copy_(theirs["model.embed_tokens.weight"])
            ours.norm.weight.copy_(theirs["model.norm.weight"])
            head = theirs.get("lm_head.weight", theirs["model.embed_tokens.weight"])  # tied
            ours.lm_head.weight.copy_(head)
        for i, layer in enumerate(ours.layers):
            layer.load_hf(theirs, f"model.layers.{i}.")
        return ours.eval()

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

    def _mask(self, positions, valid, span):
        """How this forward's queries attend, decided once for every layer: None for a prefill
        of whole rows from position 0 (the causal kernel), RowLengths for a ragged one (each
        row causal alone), else a StepMask."""
        b, t = positions.shape
        slot = torch.arange(span, device=positions.device)
        from_zero = t == span and bool((positions == slot).all())
        all_valid = bool(valid.all())
        if from_zero and all_valid:
            return None
        if from_zero and self.ragged_causal:
            lengths = valid.sum(1)
            if bool((valid == (slot < lengths[:, None])).all()):
                return RowLengths(lengths.tolist())
        if t == 1 and all_valid and bool((positions[:, 0] == span - 1).all()):
            return StepMask(None)  # one token a row, each at the last slot: it sees them all
        # Query at position p sees slots <= p; a padded query sees slot 0 (output unused).
        sees = (slot[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
        sees[..., 0] |= ~valid
        g = self.s.num_heads // self.s.num_kv_heads
        return StepMask(sees[:, None, None].expand(b, 1, g, t, span).reshape(b, 1, g * t, span))

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
        b, t = tokens.shape
        rope = rope_cos_sin(positions, self.s.head_dim, self.s.rope_theta)
        packing = None
        x = self.embed_tokens(tokens)
        mask = (
            RowsAlone(positions, valid)
            if self.row_invariant
            else self._mask(positions, valid, span)
        )
        if self.row_invariant:
            index = torch.nonzero(valid.flatten()).flatten()
            packing = Packing(index, b, t, pad=max(0, MIN_ROWS - index.numel()))
            x = packing.pack(x)
        elif not bool(valid.all()):
            index = torch.nonzero(valid.flatten()).flatten()
            packing = Packing(index, b, t)
            x = packing.pack(x)
        write = (torch.arange(b, device=tokens.device)[:, None], write_pos)
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache.k[i], cache.v[i], write, mask, span, packing)
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
        x = rms_norm(x, self.norm.weight, self.norm.eps)
        out = self.lm_head(x) if logits else x
        return (out if packing is None else packing.unpack(out)), kept
