"""How many tokens one request drafts this step: its γ schedule and its guard (engine.guard).

Choosing γ from the past alone is exact: each step samples from p given the prefix, whatever γ
was (paper §2.3). Clipping to the room left is rule 4: a block (k drafts + 1 token) must fit
max_new_tokens and, since it may end with a bonus token, the context window.
"""

from __future__ import annotations

import dataclasses

from specdecode.engine.guard import SpeculationGuard
from specdecode.engine.request import DecodeConfig
from specdecode.proposers.base import Draft

# The adaptive schedule's start, step up after a fully accepted block, and step down otherwise
# (transformers' "heuristic" schedule).
ADAPTIVE_START, ADAPTIVE_UP, ADAPTIVE_DOWN = 4, 2, 1


class GammaPolicy:
    """One request's γ plan.

    Args:
        config: the request's γ_max, schedule and guard costs.
        speculative: False when there is no proposer (every step plain).
    """

    def __init__(self, config: DecodeConfig, speculative: bool):
        self.k_max = config.num_speculative_tokens if speculative else 0
        self.adaptive = config.gamma_schedule == "adaptive"
        self.k_step = min(ADAPTIVE_START, self.k_max) if self.adaptive else self.k_max
        self.guard = SpeculationGuard(*config.costs) if config.costs is not None and self.k_max else None
        self.num_free_declined = 0  # free drafts the guard found not worth verifying

    def plan(self, tokens_left: int, max_length: int | None, committed: int) -> int:
        """γ for this step: the schedule's, 0 while the guard pauses, clipped to the room left."""
        k = self.k_step if self.guard is None or self.guard.speculate() else 0
        k = min(k, tokens_left - 1)
        if max_length is not None:
            k = min(k, max_length - committed - 1)
        return max(k, 0)

    def price(self, draft: Draft) -> Draft:
        """A free draft cut to the tokens worth verifying (engine.guard `keep`); others as they are."""
        if self.guard is None or not draft.lookup or draft.parents is not None:
            return draft
        keep = self.guard.keep(draft.support, len(draft.tokens))
        if keep == len(draft.tokens):
            return draft
        self.num_free_declined += keep == 0
        return dataclasses.replace(draft, tokens=draft.tokens[:keep], probs=draft.probs[:keep], lookup=keep > 0)

    def record(self, planned: int, drafted: int, accepted: int, draft: Draft) -> None:
        """The step's outcome: γ planned, drafts verified, drafts accepted, and the draft itself
        (its forwards; a free draft's support)."""
        if self.adaptive and planned > 0:  # a block cut short by the draft's own doubt counts as a miss
            self.k_step = min(self.k_max, self.k_step + ADAPTIVE_UP) if accepted == planned \
                else max(1, self.k_step - ADAPTIVE_DOWN)
        if self.guard is None or drafted == 0:
            return
        if draft.lookup:
            self.guard.record_free(draft.support, accepted, accepted + int(accepted < drafted))
        else:
            self.guard.record(drafted, draft.forwards, accepted + 1)
