"""Llama building blocks the drafts share: RMSNorm, rotary embeddings, attention with separate
query and key/value inputs, the SwiGLU MLP.

The attention takes its queries and its keys/values from different tensors because both drafts
need it: a DSpark block queries from its slots but reads keys and values from the target's
context features and the block itself; an EAGLE-3 step reads the cache of earlier steps. Masks
are explicit booleans (True = may attend), so every pattern is visible where it is built.

Shape glossary: N queries, M keys, H hidden, nh / nkv heads, d head dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """What a Llama decoder layer needs to know; read from the target's config.json."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int

    @classmethod
    def from_hf(cls, config: dict) -> LayerShape:
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or {}
        kind = rope.get("rope_type") or scaling.get("rope_type") or "default"
        if kind != "default":
            raise ValueError(f"rope_type {kind!r} is not supported by the draft layers")
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position=int(config.get("max_position_embeddings", 2048)),
        )


class DraftConfig:
    """JSON round trip for a draft's frozen-dataclass config (a `layer` LayerShape and
    `aux_layers` tuple inside); `kind` names the architecture in the checkpoint."""

    kind: ClassVar[str]

    def to_dict(self) -> dict:
        return {**asdict(self), "kind": self.kind, "aux_layers": list(self.aux_layers)}

    @classmethod
    def from_dict(cls, d: dict):
        d = {k: v for k, v in d.items() if k != "kind"}
        return cls(**{**d, "layer": LayerShape(**d["layer"]), "aux_layers": tuple(d["aux_layers"])})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] -> cos, sin [..., T, d], Llama's half-split layout."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [..., T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, s: LayerShape, in_features: int | None = None):
        super().__init__()
        self.s = s
        d_in = in_features or s.hidden_size
        self.q_proj = nn.Linear(d_in, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, M, in] -> k, v [B, nkv, M, d], k rotated."""
        b, m, _ = x.shape
        k = self.k_proj(x).view(b, m, self.s.num_kv_heads, self.s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, m, self.s.num_kv_heads, self.s.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, N, in] queries' input
        cos: torch.Tensor,  # [B, N, d] at the queries' positions
        sin: torch.Tensor,
        k: torch.Tensor,  # [B, nkv, M, d]
        v: torch.Tensor,
        mask: torch.Tensor,  # [B, N, M] or [N, M] bool, True = may attend
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.s.num_heads, self.s.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        return self.o_proj(gqa_attention(q, k, v, mask))


def gqa_attention(
    q: torch.Tensor,  # [B, nh, N, d]
    k: torch.Tensor,  # [B, nkv, M, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [B, N, M] or [N, M] bool, True = may attend; None: causal
) -> torch.Tensor:
    """Grouped-query attention -> [B, N, nh*d], without copying keys and values per head: the g
    query heads sharing a kv head (head h reads kv head h // g) become g*N queries of it.

    `mask=None` is plain causal attention of N queries over the same N positions (a prefill from
    position 0). SDPA's causal kernel then skips the masked half: a whole 8,000-token prefill
    of SmolLM2 took 30.5 s against the explicit mask's 63.3 here (benchmarks/prefill.py)."""
    b, nh, n, d = q.shape
    nkv, m = k.shape[1], k.shape[2]
    if mask is None:
        if n != m:
            raise ValueError(f"causal attention needs as many keys as queries, not {m} and {n}")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, n, nh * d)  # [B, nh, N, d] -> [B, N, nh*d]
    g = nh // nkv
    q = q.reshape(b, nkv, g * n, d)
    mask = mask.expand(b, n, m)[:, None, None].expand(b, 1, g, n, m).reshape(b, 1, g * n, m)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nkv, g*N, d]
    return out.reshape(b, nh, n, d).transpose(1, 2).reshape(b, n, nh * d)


class MLP(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PreNormBlock(nn.Module):
    """A Llama decoder block around any attention: x + attn(norm(x), ...), then
    x + mlp(norm(x)). The attention's extra arguments (context, cache, masks) pass through."""

    def __init__(self, s: LayerShape, attention: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))
