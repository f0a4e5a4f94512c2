"""Held-out diagnostics that tell a weak draft's failure modes apart.

Copy bias: a draft's output head and input embeddings are the target's, so a draft that learned
to echo its input would look exactly like one that cannot predict: slot 0 proposing the anchor
token (the one it was given) or a token it just saw. Counting how often slot 0 proposes the
anchor, or any of the last `window` context tokens, beside how often the target's own greedy
token is one of them, says whether the draft copies more than the data does.

Shape glossary: N blocks (anchors), B rows, S positions, W window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COPY_WINDOW = 16  # context tokens (the anchor's included) a copy may come from


def recent_tokens(draft_input: torch.Tensor, at: torch.Tensor, window: int) -> torch.Tensor:
    """draft_input [B, S] (each input token's draft index, -1 outside the draft vocabulary),
    at [N, 2] (row, anchor position) -> [N, W]: the tokens at positions p-W+1..p, the anchor
    last; -1 before the sequence starts."""
    offsets = torch.arange(1 - window, 1, device=at.device)  # [W]
    pos = at[:, 1:2] + offsets  # [N, W]
    tokens = draft_input[at[:, 0:1], pos.clamp_min(0)]
    return torch.where(pos >= 0, tokens, -1)


@dataclass
class CopyBias:
    """Running counts of slot-0 proposals (the draft's) and slot-0 truths (the target's greedy
    token) that repeat the anchor token or one of the last `window` context tokens."""

    window: int = COPY_WINDOW
    blocks: int = 0  # blocks whose slot-0 truth lies in the draft vocabulary
    draft_anchor: int = 0
    draft_recent: int = 0
    target_anchor: int = 0
    target_recent: int = 0

    def add(self, proposed: torch.Tensor, truth: torch.Tensor, recent: torch.Tensor) -> None:
        """proposed [N] the draft's slot-0 argmax, truth [N] the target's greedy token (-1 out
        of reach: not counted), recent [N, W] from `recent_tokens` (draft indices)."""
        keep = truth >= 0
        proposed, truth, recent = proposed[keep], truth[keep], recent[keep]
        anchor = recent[:, -1]
        self.blocks += int(keep.sum())
        self.draft_anchor += int((proposed == anchor).sum())
        self.target_anchor += int((truth == anchor).sum())
        self.draft_recent += int((recent == proposed[:, None]).any(-1).sum())
        self.target_recent += int((recent == truth[:, None]).any(-1).sum())

    def summary(self) -> dict:
        """Rates over the counted blocks; `excess_*` is the draft's rate over the target's (1:
        it copies exactly as often as the data does)."""
        n = max(self.blocks, 1)

        def ratio(a: int, b: int) -> float | None:
            return round(a / b, 3) if b else None

        return {
            "window": self.window,
            "blocks": self.blocks,
            "draft_anchor": round(self.draft_anchor / n, 4),
            "target_anchor": round(self.target_anchor / n, 4),
            "draft_recent": round(self.draft_recent / n, 4),
            "target_recent": round(self.target_recent / n, 4),
            "excess_anchor": ratio(self.draft_anchor, self.target_anchor),
            "excess_recent": ratio(self.draft_recent, self.target_recent),
        }
