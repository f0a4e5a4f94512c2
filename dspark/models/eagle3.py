"""EAGLE-3, the baseline: one decoder layer over fused low/mid/high target features, drafting
token by token, trained with training-time test (TTT).

Draft position i reads the embedding of token i and a feature of position i-1 (the target's,
fused by `fc`, on the first step; its own previous output on later steps) and predicts token
i+1. The layer's attention input is [input_layernorm(embed); hidden_norm(feature)] (2H wide).
As speculators trains it, the concatenated target features are normed before `fc`
(`norm_before_fc`) and the residual stream starts from the normed feature
(`norm_before_residual`, vLLM's default): SmolLM2's raw hidden states carry a few huge
dimensions, and without both a fresh draft starts confidently wrong.

TTT unrolls K steps over every position at once. Step j at index i continues the chain that
started at i: it reads token i+j, sits at position i+j, and attends to step 0's keys at indices
<= i (the context, built from target features, as the inference cache holds it) and to its own
keys from steps 1..j at index i (the diagonal). That is exactly what the draft sees when it
drafts j+1 tokens past an accepted prefix ending at i-1, so training and inference agree.

Shape glossary: B batch, S positions, H hidden, d draft vocabulary, K TTT steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dspark.models.layers import MLP, Attention, DraftConfig, LayerShape, RMSNorm, rope_cos_sin


@dataclass(frozen=True)
class Eagle3Config(DraftConfig):
    layer: LayerShape
    num_aux: int  # target layers fused by fc
    aux_layers: tuple[int, ...]
    vocab_size: int  # the target's
    draft_vocab_size: int
    ttt_steps: int  # the depth it drafts at

    kind: ClassVar[str] = "eagle3"


class Eagle3Layer(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, in_features=2 * s.hidden_size)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = self.hidden_norm(hidden) + attn_out  # residual: the normed feature, not the embedding
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """Trainable: input_norm, fc, the layer, its own final norm (initialized from the
    target's). The lm_head is the target's rows for the draft vocabulary, frozen."""

    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding):
        super().__init__()
        s = cfg.layer
        self.cfg = cfg
        self.input_norm = RMSNorm(cfg.num_aux * s.hidden_size, s.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_aux * s.hidden_size, s.hidden_size, bias=False)
        self.layer = Eagle3Layer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, cfg.draft_vocab_size, bias=False)
        self.frozen = {"embed": embed}  # a plain dict: not a submodule, so never saved or trained

    @property
    def embed(self) -> nn.Embedding:
        return self.frozen["embed"]

    def init_from_target(self, norm: nn.Module, lm_head: nn.Module, draft_ids: torch.Tensor):
        with torch.no_grad():
            self.norm.weight.copy_(norm.weight)
            self.lm_head.weight.copy_(lm_head.weight[draft_ids])

    def forward_ttt(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        aux: torch.Tensor,  # [B, S, L*H] target features
        chains: torch.Tensor,  # [B, C] int64: the index each trained chain starts at
        keep: torch.Tensor | None = None,  # [B, C] bool: real chains (the rest is padding)
        steps: int | None = None,
    ) -> torch.Tensor:
        """Unrolled training-time test -> logits [N, K, d] for the N kept chains; step j of
        the chain at index i predicts token i+j+1.

        Step 0 runs over every position, since its keys are every later step's context; steps
        1..K-1 run only over the chains, which attend to step 0's keys at indices <= their start
        and to their own earlier steps.
        """
        b, s = input_ids.shape
        c = chains.shape[1]
        k_steps = steps or self.cfg.ttt_steps
        sh = self.cfg.layer
        attn = self.layer.self_attn
        dev = input_ids.device
        index = torch.arange(s, device=dev)
        rows = torch.arange(b, device=dev)[:, None]

        fused = self.fc(self.input_norm(aux))  # [B, S, H]
        feature = torch.cat((torch.zeros_like(fused[:, :1]), fused[:, :-1]), dim=1)  # f_{i-1}
        x = self.layer.attn_input(self.embed(input_ids), feature)  # [B, S, 2H]
        cos, sin = rope_cos_sin(index[None].expand(b, s), sh.head_dim, sh.rope_theta)
        k0, v0 = attn.project_kv(x, cos, sin)  # [B, nkv, S, d]
        causal = index[None, :] <= index[:, None]  # [S, S]
        hidden = self.layer.finish(feature, attn(x, cos, sin, k0, v0, causal))
        hidden = hidden[rows, chains]  # [B, C, H]: from here on, only the chains

        context = index[None, None, :] <= chains[:, :, None]  # [B, C, S]
        diag = torch.eye(c, dtype=torch.bool, device=dev).expand(b, c, c)
        padded = torch.cat((input_ids, input_ids.new_zeros(b, k_steps)), dim=1)
        if keep is None:
            keep = torch.ones_like(chains, dtype=torch.bool)
        keys, values = [k0], [v0]
        out = [self.lm_head(self.norm(hidden[keep]))]
        for j in range(1, k_steps):
            embeds = self.embed(padded[rows, chains + j])  # token i+j
            x = self.layer.attn_input(embeds, hidden)  # [B, C, 2H]
            cos, sin = rope_cos_sin(chains + j, sh.head_dim, sh.rope_theta)
            k, v = attn.project_kv(x, cos, sin)
            keys.append(k)
            values.append(v)
            mask = torch.cat([context] + [diag] * j, dim=2)  # [B, C, S + j*C]
            a = attn(x, cos, sin, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            hidden = self.layer.finish(hidden, a)
            out.append(self.lm_head(self.norm(hidden[keep])))
        return torch.stack(out, dim=1)
