"""The DSpark draft: a block-parallel backbone (from DFlash), a low-rank Markov head and a
confidence head.

A block for anchor position p holds the anchor token x_p in slot 0 and `mask_token_id` in slots
1..B-1, at positions p..p+B-1. Every slot sees the target's context features at positions < p and
every slot of its own block (bidirectional), nothing else. Slot k predicts token p+k+1 (all B
slots draft: speculators' `sample_from_anchor`), so one backbone pass proposes B tokens.

Three options of the block-draft study change that (all off by default): `sample_from_anchor`
false is the anchor-as-bonus layout vLLM serves (slot 0 drafts nothing; slot k predicts token
p+k, B-1 tokens a pass); `block_attention: causal` lets a slot see only the slots before it;
`feature_input` adds the target's feature at position p-1 to slot 0's input (or every slot's),
as EAGLE-3 feeds it to the position it drafts from.

    context   ctx = hidden_norm(fc(concat(aux hidden states)))     [S, H], fed to every layer
              (optionally each channel scaled to unit RMS first: calibrate_context)
    layer     Qwen3-style: q from the block only, k/v from [ctx; block], q_norm/k_norm per head
    logits    lm_head(norm(h))                                     lm_head = the target's rows
    Markov    logits[k] += W2 . f(W1[x_{p+k}], h_k, state)         vanilla | gated | rnn
    confidence sigmoid(proj([h_k; W1[x_{p+k}]])) ~ P(slot k accepted)

Parameter names match speculators' DSparkDraftModel, so export is a copy plus a config.json.
The target's embedding is borrowed, frozen and held outside the module's state (never saved);
the lm_head is the target's rows for the draft vocabulary, frozen but saved, as speculators does.

Shape glossary (below; above, B is the block size): B batch, S context, A anchors, K block size,
Q = A*K queries, H hidden, r Markov rank, d draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dspark.config import DSparkDraftConfig, check_heads
from dspark.models.layers import (
    DraftConfig,
    LayerShape,
    PreNormBlock,
    RMSNorm,
    apply_rope,
    gqa_attention,
    rope_cos_sin,
)


def _recipe(name: str):
    return DSparkDraftConfig.model_fields[name].default


@dataclass(frozen=True)
class DSparkConfig(DraftConfig):
    layer: LayerShape
    num_layers: int
    block_size: int
    aux_layers: tuple[int, ...]  # decoder layers whose outputs are fused (ours: output of layer i)
    vocab_size: int  # the target's
    draft_vocab_size: int
    mask_token_id: int
    # Defaults are the params schema's (train.dspark), the one place they live.
    markov_rank: int = _recipe("markov_rank")
    markov_head: str = _recipe("markov_head")
    confidence_head: bool = _recipe("confidence_head")
    confidence_with_markov: bool = _recipe("confidence_with_markov")
    context_scale: bool = _recipe("context_scale")
    # The block-draft study's levers (train.dspark says what each does); the defaults are the
    # layout every published DSpark recipe trains.
    sample_from_anchor: bool = _recipe("sample_from_anchor")
    block_attention: str = _recipe("block_attention")
    feature_input: str = _recipe("feature_input")

    kind: ClassVar[str] = "dspark"

    def __post_init__(self):
        check_heads(self.markov_rank, self.confidence_head, self.confidence_with_markov)
        if self.block_attention not in ("bidirectional", "causal"):
            raise ValueError(f"block_attention: unknown {self.block_attention!r}")
        if self.feature_input not in ("none", "first", "all"):
            raise ValueError(f"feature_input: unknown {self.feature_input!r}")
        if self.draft_slots < 1:
            raise ValueError("block_size: the anchor-as-bonus layout needs at least 2 slots")

    @property
    def draft_slots(self) -> int:
        """Tokens one block drafts: every slot, or all but the anchor's (anchor-as-bonus)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1


class BlockAttention(nn.Module):
    """Queries from the block; keys and values from the context features and the block."""

    def __init__(self, s: LayerShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def context_kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, M, H] (context features or normed block states) -> k, v [B, nkv, M, d].
        Context keys depend only on the context, so decoding caches them per layer."""
        s = self.s
        b, m, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, m, s.num_kv_heads, s.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, m, s.num_kv_heads, s.head_dim).transpose(1, 2)
        return apply_rope(k, *rope), v

    def queries(self, x: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, Q, H] normed block states -> q [B, nh, Q, d], normed and rotated."""
        s = self.s
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, s.num_heads, s.head_dim)).transpose(1, 2)
        return apply_rope(q, *rope_q)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] normed block states
        ctx_k: torch.Tensor,  # [B, nkv, S, d] context keys (context_kv's)
        ctx_v: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],  # [B, Q, d] at the block positions
        mask: torch.Tensor,  # [B, Q, S+Q] bool: context then block
    ) -> torch.Tensor:
        k, v = self.context_kv(x, rope_q)
        k, v = torch.cat((ctx_k, k), dim=2), torch.cat((ctx_v, v), dim=2)
        return self.o_proj(gqa_attention(self.queries(x, rope_q), k, v, mask))

    def logits(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """forward's attention logits, for inspection: [B, nh, Q, S+Q] (context then block),
        -inf where masked, so their softmax is forward's attention weights."""
        q = self.queries(x, rope_q)
        k = torch.cat((ctx_k, self.context_kv(x, rope_q)[0]), dim=2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # head h reads kv head h // g
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask[:, None], float("-inf"))

    def logit_scale(self) -> float:
        """The logit of a query and a key pointing the same way, each spread evenly over the
        head's dims: q_norm and k_norm fix both lengths, so only their gains can raise it."""
        rms = [float(n.weight.pow(2).mean().sqrt()) for n in (self.q_norm, self.k_norm)]
        return self.s.head_dim**0.5 * rms[0] * rms[1]


class MarkovHead(nn.Module):
    """A low-rank bias on slot k's logits from the token before it (x_{p+k})."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head: unknown variant {kind!r}")
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)  # [gate; candidate; out]

    def step(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: prev [N] token ids, hidden [N, H] -> bias [N, d], next rnn state."""
        e = self.markov_w1(prev)  # [N, r]
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, e), dim=-1)))
            return self.markov_w2(gate * e), None
        if state is None:
            state = e.new_zeros(e.shape[0], self.rank)
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat((state, e, hidden), -1)).chunk(
            3, -1
        )
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state

    def block_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: prev [N, K] ids, hidden [N, K, H] -> [N, K, d]."""
        if self.kind == "vanilla":
            return self.markov_w2(self.markov_w1(prev))
        if self.kind == "gated":
            e = self.markov_w1(prev)
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat((hidden, e), -1))) * e)
        state, out = None, []
        for k in range(prev.shape[1]):
            bias, state = self.step(prev[:, k], hidden[:, k], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DSparkConfig, embed: nn.Embedding, lm_head_rows: torch.Tensor):
        """`embed`: the target's (frozen, shared, never saved); `lm_head_rows` [d, H]: the target
        lm_head's rows for the draft vocabulary (frozen; saved, as speculators does, because a
        runtime cannot derive a reduced head from the full one)."""
        super().__init__()
        s = cfg.layer
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layers) * s.hidden_size, s.hidden_size, bias=False)
        if cfg.context_scale:  # set from the first training batch (calibrate_context)
            self.register_buffer("aux_scale", torch.ones(len(cfg.aux_layers) * s.hidden_size))
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        # The target's feature at the last verified position, added to the anchor slot's input
        # (or every slot's), as EAGLE-3 feeds it to the position it drafts from. Zero at the
        # start, so a fresh draft begins as the plain layout does.
        self.feature_fc = None
        if cfg.feature_input != "none":
            self.feature_fc = nn.Linear(s.hidden_size, s.hidden_size, bias=False)
            nn.init.zeros_(self.feature_fc.weight)
        self.layers = nn.ModuleList(
            PreNormBlock(s, BlockAttention(s)) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, cfg.draft_vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_rows)
        self.lm_head.requires_grad_(False)
        self.markov_head = (
            MarkovHead(
                cfg.vocab_size,
                cfg.draft_vocab_size,
                cfg.markov_rank,
                s.hidden_size,
                cfg.markov_head,
            )
            if cfg.markov_rank > 0
            else None
        )
        self.confidence_head = None
        if cfg.confidence_head:  # (with Markov input only where there is a head: check_heads)
            extra = cfg.markov_rank if cfg.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(s.hidden_size + extra)
        self.frozen = {"embed": embed}  # a plain dict: not a submodule, so never saved or trained

    @property
    def embed(self) -> nn.Embedding:
        return self.frozen["embed"]

    @torch.no_grad()
    def set_qk_gain(self, gain: float) -> None:
        """Start every layer's q_norm and k_norm gains at `gain` (train.dspark.qk_norm_init)."""
        for layer in self.layers:
            layer.self_attn.q_norm.weight.fill_(gain)
            layer.self_attn.k_norm.weight.fill_(gain)

    # --- the backbone -----------------------------------------------------------------------

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, S, L*H] target features -> [B, S, H]."""
        if self.cfg.context_scale:
            aux = aux * self.aux_scale
        return self.hidden_norm(self.fc(aux))

    @torch.no_grad()
    def calibrate_context(self, square_sum: torch.Tensor, count: float) -> None:
        """Scale each feature channel to unit RMS, from its sum of squares over `count` positions.

        On SmolLM2's training data one channel of the middle and last aux layers has RMS ~1,460
        against medians of 5 and 16, and five channels hold 93-99% of those layers' energy
        (`python -m evals.feature_scale`), so a fresh fc is blind to the rest, and AdamW, which
        steps every weight alike, is slow to turn them down. A fixed scale lets the optimizer see
        the channels alike; export folds it into fc (`folded_state`)."""
        rms = (square_sum / max(count, 1.0)).sqrt().to(self.aux_scale)
        self.aux_scale.copy_(1.0 / rms.clamp_min(1e-3))

    def folded_state(self) -> dict[str, torch.Tensor]:
        """The state dict with `aux_scale` folded into fc: speculators' plain architecture."""
        state = dict(self.state_dict())
        if self.cfg.context_scale:
            scale = state.pop("aux_scale")
            state["fc.weight"] = state["fc.weight"] * scale[None, :]
        return state

    def block_input(self, block_ids: torch.Tensor, prev_feature: torch.Tensor) -> torch.Tensor:
        """block_ids [..., K], prev_feature [..., H] (the context feature at the anchor's
        position - 1) -> the slots' input states [..., K, H]."""
        x = self.embed(block_ids)
        if self.feature_fc is None:
            return x
        feature = self.feature_fc(prev_feature)[..., None, :]  # [..., 1, H]
        if self.cfg.feature_input == "first":
            return torch.cat((x[..., :1, :] + feature, x[..., 1:, :]), dim=-2)
        return x + feature

    def backbone(
        self,
        ctx: torch.Tensor,  # [B, S, H]
        anchor_ids: torch.Tensor,  # [B, A] the anchor tokens
        anchors: torch.Tensor,  # [B, A] their positions
        ctx_len: torch.Tensor | None = None,  # [B] context length per row (default: all of S)
        attention: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """-> normed hidden states [B, A, K, H] for every slot of every block. A list passed as
        `attention` gets each layer's attention logits [B, nh, A*K, S+A*K] (inspection)."""
        b, s, _ = ctx.shape
        a = anchors.shape[1]
        k = self.cfg.block_size
        sh = self.cfg.layer
        dev = ctx.device
        slot = torch.arange(k, device=dev)
        block_ids = torch.full((b, a, k), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = anchor_ids
        rows = torch.arange(b, device=dev)[:, None]
        prev_feature = ctx[rows, (anchors - 1).clamp_min(0)]  # [B, A, H]
        x = self.block_input(block_ids, prev_feature).view(b, a * k, -1)  # [B, Q, H]
        block_pos = (anchors[:, :, None] + slot).view(b, a * k)  # [B, Q]
        ctx_pos = torch.arange(s, device=dev).expand(b, s)
        rope_q = rope_cos_sin(block_pos, sh.head_dim, sh.rope_theta)
        rope_ctx = rope_cos_sin(ctx_pos, sh.head_dim, sh.rope_theta)
        mask = block_mask(anchors, k, s, ctx_len, causal=self.cfg.block_attention == "causal")
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, rope_ctx)
            if attention is not None:
                normed = layer.input_layernorm(x)
                attention.append(layer.self_attn.logits(normed, ctx_k, rope_q, mask))
            x = layer(x, ctx_k, ctx_v, rope_q, mask)
        return self.norm(x).view(b, a, k, -1)

    def draft_hidden(
        self,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: cached [B, nkv, S, d]
        ctx_len: torch.Tensor,  # [B] context positions each row has (= its anchor position)
        anchor_ids: torch.Tensor,  # [B]
        prev_feature: torch.Tensor | None = None,  # [B, H] context feature at ctx_len - 1
    ) -> torch.Tensor:
        """Decoding: one block per row at its anchor over cached context keys -> the drafting
        slots' states [B, draft_slots, H] (every slot, or all but the anchor's)."""
        b, k, sh = anchor_ids.shape[0], self.cfg.block_size, self.cfg.layer
        dev = anchor_ids.device
        span = ctx_kv[0][0].shape[2]
        slot = torch.arange(k, device=dev)
        block_ids = torch.full((b, k), self.cfg.mask_token_id, device=dev)
        block_ids[:, 0] = anchor_ids
        rope_q = rope_cos_sin(ctx_len[:, None] + slot, sh.head_dim, sh.rope_theta)
        sees_ctx = torch.arange(span, device=dev)[None, :] < ctx_len[:, None]
        in_block = torch.ones(k, k, dtype=torch.bool, device=dev)
        if self.cfg.block_attention == "causal":
            in_block = in_block.tril()
        mask = torch.cat(
            (sees_ctx[:, None].expand(b, k, span), in_block.expand(b, k, k)), dim=2
        )  # [B, K, S+K]
        if self.feature_fc is not None and prev_feature is None:
            raise ValueError(
                "feature_input: this draft needs the context feature before its anchor"
            )
        x = self.block_input(block_ids, prev_feature)  # [B, K, H]
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, ctx_k, ctx_v, rope_q, mask)
        return self.norm(x)[:, k - self.cfg.draft_slots :]

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., H], prev [...] (the token before each slot's) -> logits [...] or None."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.cfg.confidence_with_markov:
            feats = torch.cat((hidden, self.markov_head.markov_w1(prev)), dim=-1)
        return self.confidence_head(feats)

    # --- heads ------------------------------------------------------------------------------

    def heads(
        self, hidden: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced heads. hidden [N, K, H], prev [N, K] (the token before each slot's)
        -> logits [N, K, d] with the Markov bias, confidence logits [N, K] or None."""
        logits = self.lm_head(hidden)
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(prev, hidden)
        return logits, self.confidence(hidden, prev)

    def forward_train(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        aux: torch.Tensor,  # [B, S, L*H]
        anchors: torch.Tensor,  # [B, A] int64 anchor positions
        keep: torch.Tensor | None = None,  # [B, A] bool: real anchors (the rest is padding)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All blocks of every sequence in one pass -> logits [N, K, d] and confidence logits
        [N, K] for the N kept anchors (row-major), so padding never reaches the heads. K is
        the drafting slots (`draft_slots`): drafting slot k predicts x_{p+k+1} in either
        layout, from block position k (every slot drafts) or k+1 (anchor-as-bonus).

        Slot k's Markov input is the true token x_{p+k} (teacher forcing)."""
        b, s = input_ids.shape
        k = self.cfg.draft_slots
        if keep is None:
            keep = torch.ones_like(anchors, dtype=torch.bool)
        rows = torch.arange(b, device=input_ids.device)[:, None]
        hidden = self.backbone(self.context(aux), input_ids[rows, anchors], anchors)
        hidden = hidden[:, :, self.cfg.block_size - k :]  # the drafting slots [B, A, K, H]
        idx = (anchors[:, :, None] + torch.arange(k, device=anchors.device)).clamp_max(s - 1)
        prev = input_ids[rows[:, :, None], idx]  # [B, A, K]
        return self.heads(hidden[keep], prev[keep])


def block_mask(
    anchors: torch.Tensor,
    block_size: int,
    ctx_len: int,
    valid_ctx: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """[B, A*K, S + A*K] bool: slot -> (context position < its anchor) | (its own block: every
    slot of it, or with `causal` only itself and the slots before it)."""
    b, a = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx_pos = torch.arange(ctx_len, device=dev)
    sees_ctx = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [B, Q, S]
    if valid_ctx is not None:
        sees_ctx &= ctx_pos[None, None, :] < valid_ctx[:, None, None]
    q = torch.arange(a * block_size, device=dev)
    same_block = (q[:, None] // block_size) == (q[None, :] // block_size)  # [Q, Q]
    if causal:
        same_block &= q[None, :] <= q[:, None]
    return torch.cat((sees_ctx, same_block.expand(b, -1, -1)), dim=2)
