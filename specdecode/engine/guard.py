"""Corollary 3.9 at run time: speculate only while it pays.

Speculation pays iff α > c (paper Cor. 3.9). In the paper's cost model (Thm 3.8: a target call
costs 1 whatever its length, a draft forward costs c) a speculative step that made d draft
forwards and emitted n tokens cost (1 + d·c) / n per token against 1 for a plain step. On a CPU
a call verifying k drafts costs r(k+1) > 1 (measured: `specdecode bench`), so the guard charges
1 + slope·k for the call, slope = (r(γ+1) − 1) / γ measured at load. The guard
keeps running averages of the cost and of the tokens emitted over the request's speculative
steps (the prompt and the text move α) and pauses drafting while their ratio, the cost per token,
is above 1; while paused the loop decodes plainly, and it probes speculation again every
`probe_every` steps. (A ratio of averages, not an average of per-step ratios: steps that emit one
token cost the most per token, so averaging per-step ratios overstates the cost and paused a
draft with α ≈ 0.85 three times in four HumanEval prompts.)

Where c and the slope come from: measured at load (SpeculativeDecoder), then kept current from the
loop's own timings (engine.cost, `set_costs`): a load spike during the start-up measurement would
otherwise pause drafting for the whole run. The averages are kept per term (drafts verified, draft
forwards, tokens), so new costs re-price the whole history at once. Only greedy and unseeded
requests are guarded (SpeculativeDecoder.config): a greedy output does not depend on when drafting
pauses, and an unseeded one promises no reproducibility. Choosing γ (here: 0 or γ_max) from the
past is exact: each step samples from p given the prefix, whatever γ was (paper §2.3).
"""

from __future__ import annotations


class SpeculationGuard:
    """Decides, step by step, whether to draft.

    Args:
        cost_coefficient: c, a draft forward's cost in target calls (Def. 3.7), >= 0.
        verify_slope: extra cost of each draft verified in a target call, in target calls (>= 0).
        probe_every: plain steps between probes while paused (>= 1).
        decay: weight of the past in the running average, in [0, 1).
        warmup: speculative steps before the first judgement (one step is noisy), >= 1.
    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, cost_coefficient: float, verify_slope: float = 0.0, probe_every: int = 16,
                 decay: float = 0.8, warmup: int = 4):
        if cost_coefficient < 0 or verify_slope < 0 or probe_every < 1 or not 0 <= decay < 1 or warmup < 1:
            raise ValueError("need cost_coefficient, verify_slope >= 0, probe_every >= 1, decay in [0, 1), warmup >= 1")
        self.c, self.slope, self.probe_every = cost_coefficient, verify_slope, probe_every
        self.decay, self.warmup = decay, warmup
        self.cost_per_token: float | None = None  # target calls per token, from the averages
        self._drafted = self._forwards = self._tokens = 0.0  # running averages per speculative step
        self.num_speculative_steps = 0
        self.paused_for = 0
        self.num_pauses = 0

    def set_costs(self, cost_coefficient: float, verify_slope: float) -> None:
        """New c and slope (from the loop's timings); they apply to the steps already recorded too."""
        self.c, self.slope = max(cost_coefficient, 0.0), max(verify_slope, 0.0)
        if self.num_speculative_steps:
            self.cost_per_token = self._cost() / self._tokens

    def _cost(self) -> float:
        return 1 + self.slope * self._drafted + self.c * self._forwards

    def speculate(self) -> bool:
        """Draft on this step?"""
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        return True

    def record(self, num_drafted: int, num_draft_forwards: int, num_emitted: int) -> None:
        """One speculative step: drafts verified, draft forwards made, tokens emitted (>= 1)."""
        weight = 1.0 if self.num_speculative_steps == 0 else 1 - self.decay
        self._drafted += weight * (num_drafted - self._drafted)
        self._forwards += weight * (num_draft_forwards - self._forwards)
        self._tokens += weight * (max(num_emitted, 1) - self._tokens)
        self.cost_per_token = self._cost() / self._tokens
        self.num_speculative_steps += 1
        if self.num_speculative_steps >= self.warmup and self.cost_per_token > 1:
            self.paused_for = self.probe_every
            self.num_pauses += 1
