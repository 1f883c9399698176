"""How many tokens one request drafts this step: its γ schedule and its guard (engine.guard).

Choosing γ from the past alone is exact: each step samples from p given the prefix, whatever γ
was (paper §2.3). Clipping to the room left is rule 4: a block (k drafts + 1 token) must fit
max_new_tokens and, since it may end with a bonus token, the context window.
"""

from __future__ import annotations

from specdecode.engine.guard import SpeculationGuard
from specdecode.engine.request import DecodeConfig

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

    def plan(self, tokens_left: int, max_length: int | None, committed: int) -> int:
        """γ for this step: the schedule's, 0 while the guard pauses, clipped to the room left."""
        k = self.k_step if self.guard is None or self.guard.speculate() else 0
        k = min(k, tokens_left - 1)
        if max_length is not None:
            k = min(k, max_length - committed - 1)
        return max(k, 0)

    def record(self, planned: int, drafted: int, accepted: int, draft_forwards: int) -> None:
        """The step's outcome: γ planned, drafts verified, drafts accepted, draft forwards made."""
        if self.adaptive and planned > 0:  # a block cut short by the draft's own doubt counts as a miss
            self.k_step = min(self.k_max, self.k_step + ADAPTIVE_UP) if accepted == planned \
                else max(1, self.k_step - ADAPTIVE_DOWN)
        if self.guard is not None and drafted > 0:
            self.guard.record(drafted, draft_forwards, accepted + 1)
