"""The DFlash draft: DSpark's block-parallel backbone alone, without the Markov and confidence
heads (DSpark is DFlash plus those two). One backbone pass drafts a whole block, every slot from
the context and its own block only, so no slot sees the token chosen for the slot before it.

Same module as DSpark (dspark/models/dspark.py) with both heads off, so the two compare on the
heads alone: same block size, context fusion, mask token and frozen lm_head rows. Every slot
drafts, as in DeepSpec's DFlash recipe (the seed's own baseline) and speculators'
`sample_from_anchor`. Its authors' loss, cross-entropy alone decayed exp(-k/gamma) over the
slots, is set by `train.dflash`; the checkpoint is exported in speculators' DFlash format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark.models.dspark import DSparkConfig, DSparkDraft


@dataclass(frozen=True)
class DFlashConfig(DSparkConfig):
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_with_markov: bool = False

    kind: ClassVar[str] = "dflash"

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank or self.confidence_head or self.confidence_with_markov:
            raise ValueError("a DFlash draft has no Markov or confidence head")


class DFlashDraft(DSparkDraft):
    """DSparkDraft built from a DFlashConfig: the backbone and the target's lm_head rows."""

    cfg: DFlashConfig
