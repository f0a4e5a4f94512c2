"""The trained drafts as proposers, each with its own static cache of the target's features.

DSpark (and DFlash, its backbone alone): the context is the fused features of every position
before the anchor; each layer's keys and values of it depend on nothing else, so they are cached
as positions become final. One backbone pass drafts a whole block; DSpark's Markov head then runs
slot by slot, each slot conditioned on the token actually chosen for the slot before it, with a
confidence per slot.

EAGLE-3: index i of its cache holds the keys of [embed(x_i); feature f_{i-1}] (f_{-1} = 0), as
step 0 of training-time test builds them. Drafting starts from step 0's output at the anchor and
runs one step per token, each attending to the cache up to the anchor and to its own earlier steps.

Shape glossary: B rows, M slots, T new positions, K drafted tokens, H hidden, d draft vocabulary,
V the target's vocabulary.
"""

from __future__ import annotations

import torch

from dspark.decode.proposers import ALL, Proposal, Proposer
from dspark.decode.sampling import Sampling, choose
from dspark.models.dspark import DSparkDraft
from dspark.models.eagle3 import Eagle3Draft
from dspark.models.layers import rope_cos_sin


def _slots(start: torch.Tensor, count: torch.Tensor, width: int, scratch: int):
    """Positions start..start+width-1 per row -> (positions [B, T], valid [B, T], where each
    writes [B, T]: padding goes to the scratch slot)."""
    offset = torch.arange(width)
    positions = start[:, None] + offset
    valid = offset[None, :] < count[:, None]
    return positions, valid, torch.where(valid, positions, scratch)


def _full_vocab(probs: torch.Tensor | None, draft_ids: torch.Tensor, vocab: int):
    """[B, d] probabilities over the draft vocabulary -> [B, V] over the target's."""
    if probs is None:
        return None
    return probs.new_zeros(probs.shape[0], vocab).index_copy_(1, draft_ids, probs)


class DraftProposer(Proposer):
    """A trained draft (frozen) over its reduced vocabulary `draft_ids`, drafting k tokens from
    the target's layers `taps`, with key/value caches of its own."""

    def __init__(self, model, draft_ids: torch.Tensor, k: int):
        self.model = model.eval().requires_grad_(False)
        self.draft_ids, self.k, self.taps = draft_ids, k, model.cfg.aux_layers

    def new_kv(self, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values for `slots` positions per row, plus the scratch slot."""
        s = self.model.cfg.layer
        shape = (batch, s.num_kv_heads, slots + 1, s.head_dim)
        w = self.model.fc.weight
        self.scratch = slots
        return w.new_zeros(shape), w.new_zeros(shape)


class DSparkProposer(DraftProposer):
    """While `holding` (drafts are rare: `dspark_adaptive` where they do not pay), `extend`
    only keeps the new positions' features, up to `held` per row, and `propose` first turns
    them into cache entries in one batched pass instead of a small, overhead-bound one per
    step."""

    name = "dspark"

    def __init__(self, model: DSparkDraft, draft_ids: torch.Tensor, held: int = 128):
        super().__init__(model, draft_ids, model.cfg.draft_slots)
        self.held = held

    def start(self, batch, slots):
        self.cache = [self.new_kv(batch, slots) for _ in self.model.layers]
        # The fused context feature per position, for drafts that feed the one before the
        # anchor into the block (feature_input); the scratch slot at the end, as the keys'.
        self.features = None
        if self.model.feature_fc is not None:
            h = self.model.cfg.layer.hidden_size
            self.features = self.model.fc.weight.new_zeros(batch, slots + 1, h)
        width = len(self.taps) * self.model.cfg.layer.hidden_size
        self.held_aux = self.model.fc.weight.new_zeros(batch, self.held, width)  # [B, W, L*H]
        self.held_from = torch.zeros(batch, dtype=torch.long)  # the first held position
        self.held_count = torch.zeros(batch, dtype=torch.long)
        self._holds = False  # any held position: spares a step that holds none a tensor check

    @torch.no_grad()
    def extend(self, seq, start, count, feats, rows=ALL):
        aux = torch.cat([feats[i] for i in self.taps], dim=-1)  # [B, T, L*H]
        if not self.holding or aux.shape[1] > self.held:  # (a prompt longer than the store)
            self.flush()  # held entries first: the rows' new ones may overwrite them
            self._write(aux, start, count, rows)
            return
        held_from, held_count = self.held_from[rows], self.held_count[rows]
        # A row's held positions must run on into the new ones (a row given a new request
        # starts again at 0), and fit.
        gaining = count > 0
        broken = gaining & (held_count > 0) & (held_from + held_count != start)
        if bool(broken.any()) or int((held_count + count).max()) > self.held:
            self.flush()
        offset = held_count[:, None] + torch.arange(aux.shape[1])  # [B, T]
        keep = torch.arange(aux.shape[1])[None, :] < count[:, None]
        b_idx = torch.arange(aux.shape[0])[:, None].expand_as(offset)
        self.held_aux[rows][b_idx[keep], offset[keep]] = aux[keep]
        held_from.copy_(torch.where(gaining & (held_count == 0), start, held_from))
        held_count += count
        self._holds = True

    @torch.no_grad()
    def flush(self) -> None:
        """Every held position into the cache."""
        if not self._holds:
            return
        width = int(self.held_count.max())
        if width:
            self._write(self.held_aux[:, :width], self.held_from, self.held_count, ALL)
        self.held_count.zero_()
        self._holds = False

    def _write(self, aux, start, count, rows):
        positions, _, write = _slots(start, count, aux.shape[1], self.scratch)
        s = self.model.cfg.layer
        rope = rope_cos_sin(positions, s.head_dim, s.rope_theta)
        ctx = self.model.context(aux)
        idx = torch.arange(aux.shape[0])[:, None]
        for layer, (cache_k, cache_v) in zip(self.model.layers, self.cache, strict=True):
            k, v = layer.self_attn.context_kv(ctx, rope)  # [B, nkv, T, d]
            cache_k[rows][idx, :, write] = k.transpose(1, 2)
            cache_v[rows][idx, :, write] = v.transpose(1, 2)
        if self.features is not None:
            self.features[rows][idx, write] = ctx

    @torch.no_grad()
    def propose(self, seq, n, active, sampling: Sampling, gen, rows=ALL):
        self.flush()
        m = self.model
        b = seq.shape[0]
        span = int(n.max())
        anchor = seq[torch.arange(b), n]
        ctx_kv = [(k[rows, :, :span], v[rows, :, :span]) for k, v in self.cache]
        before = None
        if self.features is not None:  # the feature before each row's anchor (n >= 1)
            before = self.features[rows][torch.arange(b), (n - 1).clamp_min(0)]
        hidden = m.draft_hidden(ctx_kv, n, anchor, before)  # [B, K, H]: the drafting slots
        base = m.lm_head(hidden)  # [B, K, d]
        prev, state = anchor, None
        tokens, qs, confs = [], [], []
        for j in range(self.k):
            logits = base[:, j]
            if m.markov_head is not None:
                bias, state = m.markov_head.step(prev, hidden[:, j], state)
                logits = logits + bias
            conf = m.confidence(hidden[:, j], prev)
            if conf is not None:
                confs.append(torch.sigmoid(conf))
            picked, probs = choose(logits, sampling, gen)
            prev = self.draft_ids[picked]
            tokens.append(prev)
            qs.append(_full_vocab(probs, self.draft_ids, m.cfg.vocab_size))
        return Proposal(
            torch.stack(tokens, 1),
            torch.full((b,), self.k),
            None if sampling.greedy else torch.stack(qs, 1),
            torch.stack(confs, 1) if confs else None,
        )


class DFlashProposer(DSparkProposer):
    """DSpark's proposer over a draft without heads: one backbone pass, each slot's argmax (or
    sample) on its own, a fixed block per step."""

    name = "dflash"


class Eagle3Proposer(DraftProposer):
    name = "eagle3"

    def __init__(self, model: Eagle3Draft, draft_ids: torch.Tensor):
        super().__init__(model, draft_ids, model.cfg.ttt_steps)

    def start(self, batch, slots):
        self.cache_k, self.cache_v = self.new_kv(batch, slots)
        hidden = self.model.cfg.layer.hidden_size
        self.anchor_hidden = self.cache_k.new_zeros(batch, hidden)  # step 0's output at anchor

    def _rope(self, positions):
        s = self.model.cfg.layer
        return rope_cos_sin(positions, s.head_dim, s.rope_theta)

    @torch.no_grad()
    def extend(self, seq, start, count, feats, rows=ALL):
        """Writes step 0's keys for indices start+1..start+count (and index 0 on a row's first
        call), then runs step 0 at the new anchor, index start+count."""
        m, layer = self.model, self.model.layer
        b = seq.shape[0]
        idx = torch.arange(b)
        cache_k, cache_v = self.cache_k[rows], self.cache_v[rows]
        fused = m.fc(m.input_norm(torch.cat([feats[i] for i in self.taps], dim=-1)))  # [B, T, H]
        feature = torch.cat((fused.new_zeros(b, 1, fused.shape[2]), fused), dim=1)  # f_{i-1}
        positions, valid, write = _slots(start, count + 1, feature.shape[1], self.scratch)
        valid[:, 0] &= start == 0  # index `start` already holds its keys unless it is 0
        write = torch.where(valid, write, self.scratch)
        tokens = seq.gather(1, positions.clamp_max(seq.shape[1] - 1))
        x = layer.attn_input(m.embed(tokens), feature)  # [B, T+1, 2H]
        cos, sin = self._rope(positions)
        k, v = layer.self_attn.project_kv(x, cos, sin)
        cache_k[idx[:, None], :, write] = k.transpose(1, 2)
        cache_v[idx[:, None], :, write] = v.transpose(1, 2)
        # Step 0 at each gaining row's anchor (index start+count, the entry `count` in).
        grew = count > 0
        at = count[:, None]
        anchor_x = x[idx, count][:, None]  # [B, 1, 2H]
        anchor_pos = positions.gather(1, at)
        span = int(anchor_pos.max()) + 1
        mask = torch.arange(span)[None, None, :] <= anchor_pos[:, :, None]  # [B, 1, span]
        cos, sin = self._rope(anchor_pos)
        out = layer.self_attn(anchor_x, cos, sin, cache_k[:, :, :span], cache_v[:, :, :span], mask)
        hidden = layer.finish(feature[idx, count][:, None], out)[:, 0]
        held = self.anchor_hidden[rows]
        held.copy_(torch.where(grew[:, None], hidden, held))

    @torch.no_grad()
    def propose(self, seq, n, active, sampling: Sampling, gen, rows=ALL):
        m, layer = self.model, self.model.layer
        b = seq.shape[0]
        idx = torch.arange(b)
        cache_k, cache_v = self.cache_k[rows], self.cache_v[rows]
        hidden = self.anchor_hidden[rows]
        tokens, qs = [], []
        for j in range(self.k):
            logits = m.lm_head(m.norm(hidden))  # [B, d]
            picked, probs = choose(logits, sampling, gen)
            token = self.draft_ids[picked]
            tokens.append(token)
            qs.append(_full_vocab(probs, self.draft_ids, m.cfg.vocab_size))
            if j == self.k - 1:
                break
            # Where this draft token sits. A finished row's last step may have run up to k
            # tokens past its budget, and the cache has room for one block past it, not two:
            # its drafts (never verified) sit at 0 and go to the scratch slot.
            at = torch.where(active, n + j + 1, 0)  # [B]
            x = layer.attn_input(m.embed(token), hidden)[:, None]  # [B, 1, 2H]
            cos, sin = self._rope(at[:, None])
            k, v = layer.self_attn.project_kv(x, cos, sin)  # [B, nkv, 1, d]
            # Into the cache past the row's last token, as the target's drafts go into its
            # own: nothing reads there until `extend` writes the accepted tokens' keys over
            # them, and no copy of the context's keys is made per step.
            write = torch.where(active, at, self.scratch)
            cache_k[idx, :, write] = k[:, :, 0]
            cache_v[idx, :, write] = v[:, :, 0]
            span = int(at.max()) + 1
            mask = (torch.arange(span)[None, :] <= at[:, None])[:, None]  # [B, 1, span]
            out = layer.self_attn(x, cos, sin, cache_k[:, :, :span], cache_v[:, :, :span], mask)
            hidden = layer.finish(hidden[:, None], out)[:, 0]
        return Proposal(
            torch.stack(tokens, 1),
            torch.full((b,), self.k),
            None if sampling.greedy else torch.stack(qs, 1),
        )
