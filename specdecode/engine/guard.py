"""Corollary 3.9 at run time: speculate only while it pays.

Speculation pays iff α > c (paper Cor. 3.9). In the paper's cost model (Thm 3.8: a target call
costs 1 whatever its length, a draft forward costs c) a speculative step that made d draft
forwards and emitted n tokens cost (1 + d·c) / n per token against 1 for a plain step. On a CPU
a call verifying k drafts costs r(k+1) > 1 (measured: `specdecode bench`), so the guard charges
1 + base + slope·k for the call (below), measured at load from r(2) and r(γ+1). The guard keeps
running averages of the cost and of the tokens emitted over the request's speculative
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

A verify call's cost is affine in the drafts it scores: 1 + base + slope·k target steps for k >= 1
drafts, the line through r(2) and r(γ+1) (base: what any call wider than one token costs extra; a
Q4_K_M target on llama.cpp leaves its one-token kernels there: r(2) = 1.40 and r(9) = 2.96 give
slope 0.22 and base 0.18, where the line from r(1) to r(9) alone would price r(2) at 1.25).

Free drafts (prompt lookup, suffix matches) cost no forward, so the pause above is the wrong tool
for them: one weak match should not stop the strong ones after it. Each free draft is priced on
its own instead (`keep`): of its n tokens the guard verifies the j that maximize the tokens a call
is expected to emit per unit of its cost, E_j / (1 + base + slope·j) with E_j = (1 − α^{j+1}) /
(1 − α) (paper Eq. 1), and none where no j beats a plain step by FREE_MARGIN. α is this request's
own acceptance of free drafts with the same support (the length of the match they were copied
from: measured on the default pair, a 2-token match's drafts were accepted 0.55 a token, a 4-token
one's 0.78, an 8-token one's 0.98), starting from support / (support + 1.5) worth FREE_PRIOR_TOKENS
tokens (0.57, 0.73, 0.84: after one miss a 2-token match's drafts are declined). Steps with free
drafts do not count towards the pause, which judges the draft model alone. Truncating a draft by
what the past says is exact for the same reason as choosing γ (§2.3).
"""

from __future__ import annotations


FREE_MARGIN = 0.05       # a free draft is verified only if it promises 5% more tokens per unit cost
FREE_PRIOR_TOKENS = 2.0  # weight of the prior α of a free draft's support, in verified tokens


class SpeculationGuard:
    """Decides, step by step, whether to draft.

    Args:
        cost_coefficient: c, a draft forward's cost in target calls (Def. 3.7), >= 0.
        verify_slope: extra cost of each draft verified in a target call, in target calls (>= 0).
        verify_base: extra cost of a call that verifies any drafts at all, in target calls (>= 0).
        probe_every: plain steps between probes while paused (>= 1).
        decay: weight of the past in the running average, in [0, 1).
        warmup: speculative steps before the first judgement (one step is noisy), >= 1.
    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, cost_coefficient: float, verify_slope: float = 0.0, verify_base: float = 0.0,
                 probe_every: int = 16, decay: float = 0.8, warmup: int = 4):
        if min(cost_coefficient, verify_slope, verify_base) < 0 or probe_every < 1 or not 0 <= decay < 1 or warmup < 1:
            raise ValueError("need cost_coefficient, verify_slope, verify_base >= 0, probe_every >= 1, "
                             "decay in [0, 1), warmup >= 1")
        self.c, self.slope, self.base, self.probe_every = cost_coefficient, verify_slope, verify_base, probe_every
        self.decay, self.warmup = decay, warmup
        self.cost_per_token: float | None = None  # target calls per token, from the averages
        self._drafted = self._forwards = self._tokens = 0.0  # running averages per speculative step
        self.num_speculative_steps = 0
        self.paused_for = 0
        self.num_pauses = 0
        self._free: dict[int, list[int]] = {}  # support -> [drafts accepted, drafts verified]

    def set_costs(self, cost_coefficient: float, verify_slope: float) -> None:
        """New c and slope (from the loop's timings; the base stays as measured at load); they
        apply to the steps already recorded too."""
        self.c, self.slope = max(cost_coefficient, 0.0), max(verify_slope, 0.0)
        if self.num_speculative_steps:
            self.cost_per_token = self._cost() / self._tokens

    def _cost(self) -> float:
        return 1 + self.base + self.slope * self._drafted + self.c * self._forwards

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

    def free_alpha(self, support: int) -> float:
        """This request's acceptance rate of free drafts copied from a match of `support` tokens,
        with the prior support / (support + 1.5) worth FREE_PRIOR_TOKENS verified tokens."""
        accepted, verified = self._free.get(support, (0, 0))
        prior = support / (support + 1.5)
        return (accepted + prior * FREE_PRIOR_TOKENS) / (verified + FREE_PRIOR_TOKENS)

    def keep(self, support: int, offered: int) -> int:
        """How many of a free draft's `offered` tokens to verify (0..offered): the j maximizing
        E_j / (1 + base + slope·j), or 0 where that is not FREE_MARGIN above a plain step's 1."""
        alpha = min(self.free_alpha(support), 1 - 1e-9)
        best, best_rate = 0, 1 + FREE_MARGIN
        for j in range(1, offered + 1):
            rate = (1 - alpha ** (j + 1)) / (1 - alpha) / (1 + self.base + self.slope * j)
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    def record_free(self, support: int, accepted: int, verified: int) -> None:
        """One step's free draft: `accepted` of its tokens accepted out of `verified` judged (the
        accepted ones and the rejected one, if any)."""
        counts = self._free.setdefault(support, [0, 0])
        counts[0] += accepted
        counts[1] += verified
