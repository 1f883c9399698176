"""Corollary 3.9 at run time: speculate only while it pays.

Speculation pays iff α > c (paper Cor. 3.9). In the paper's cost model (Thm 3.8: a target call
costs 1 whatever its length, a draft forward costs c) a speculative step that made d draft
forwards and emitted n tokens cost (1 + d·c) / n per token against 1 for a plain step. On a CPU
a call verifying k drafts costs r(k+1) > 1 (measured: `specdecode bench`), so the guard charges
1 + base + slope·k for the call (below), measured at load from r(2) and r(γ+1). The guard keeps
running statistics of each speculative step's gain, tokens emitted minus cost in target steps
(the prompt and the text move α), and pauses drafting only where they say, beyond one standard
error, that a speculative step gains less than a plain one (mean gain < 0, i.e. more than one
target step per token); while paused the loop decodes plainly, and it probes speculation again
every `probe_every` steps. Gains are weighed over the last ~10 steps (decay 0.9) and the first
judgement waits for 3 steps. (A mean of gains, i.e. a ratio of sums, not an average of
per-step ratios: steps that emit one token cost the most per token, so averaging per-step ratios
overstates the cost and paused a draft with α ≈ 0.85 three times in four HumanEval prompts. The
standard error: a Spec-Bench chat answer whose draft accepted about half its tokens, and paid
1.45x unguarded, lost four misses in its first five steps and was paused five times for 16
steps, 0.70x of its unguarded speed; a draft that never pays has steady gains, small errors, and
is paused as early as before. Replayed over the recorded steps of 18 Spec-Bench answers
(benchmarks/guard_replay.py, docs/results/guard_replay.md): at the costs measured at load every
answer ran as fast as unguarded, 2.18x plain decoding (the earlier rule: 2.13x, one answer 2.56x
→ 1.78x); at c = 0.3, 1.22x against 1.18x; where drafting rarely pays (c = 0.6) 0.95x against
0.96x; a draft that never pays ran 0.98x / 0.93x / 0.88x of plain at those costs (earlier rule
0.98x / 0.92x / 0.85x, unguarded 0.84x / 0.56x / 0.38x).)

Where c and the slope come from: measured at load (SpeculativeDecoder), then kept current from the
loop's own timings (engine.cost, `set_costs`): a load spike during the start-up measurement would
otherwise pause drafting for the whole run. The statistics are kept per term (weighted sums of
drafts verified, draft forwards and tokens, and of their products), so new costs re-price the
whole history at once. Only greedy and unseeded requests are guarded (SpeculativeDecoder.config):
a greedy output does not depend on when drafting pauses, and an unseeded one promises no
reproducibility. Choosing γ (here: 0 or γ_max) from the
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

import math


FREE_MARGIN = 0.05       # a free draft is verified only if it promises 5% more tokens per unit cost
FREE_PRIOR_TOKENS = 2.0  # weight of the prior α of a free draft's support, in verified tokens


class SpeculationGuard:
    """Decides, step by step, whether to draft.

    Args:
        cost_coefficient: c, a draft forward's cost in target calls (Def. 3.7), >= 0.
        verify_slope: extra cost of each draft verified in a target call, in target calls (>= 0).
        verify_base: extra cost of a call that verifies any drafts at all, in target calls (>= 0).
        probe_every: plain steps between probes while paused (>= 1).
        decay: weight of the past in the running statistics, per step, in [0, 1).
        warmup: speculative steps before the first judgement (one step is noisy), >= 1.
        margin: how many standard errors below zero the mean gain must be to pause (>= 0; 0 is
            the earlier rule, which paused on the mean alone).
    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, cost_coefficient: float, verify_slope: float = 0.0, verify_base: float = 0.0,
                 probe_every: int = 16, decay: float = 0.9, warmup: int = 3, margin: float = 1.0):
        if min(cost_coefficient, verify_slope, verify_base, margin) < 0 or probe_every < 1 or not 0 <= decay < 1 \
                or warmup < 1:
            raise ValueError("need cost_coefficient, verify_slope, verify_base, margin >= 0, probe_every >= 1, "
                             "decay in [0, 1), warmup >= 1")
        self.c, self.slope, self.base, self.probe_every = cost_coefficient, verify_slope, verify_base, probe_every
        self.decay, self.warmup, self.margin = decay, warmup, margin
        # Exponentially weighted sums over the speculative steps of v = (drafts verified, draft
        # forwards, tokens emitted) and of v v^T, with the sums of the weights and of their squares
        self._weights = self._squared_weights = 0.0
        self._sum = [0.0] * 3
        self._sum_products = [[0.0] * 3 for _ in range(3)]
        self.num_speculative_steps = 0
        self.paused_for = 0
        self.num_pauses = 0
        self._free: dict[int, list[int]] = {}  # support -> [drafts accepted, drafts verified]

    def set_costs(self, cost_coefficient: float, verify_slope: float) -> None:
        """New c and slope (from the loop's timings; the base stays as measured at load); they
        apply to the steps already recorded too. A value that is not a finite number (a timing
        gone wrong) leaves the old one: a NaN cost would make every gain NaN and never pause."""
        if math.isfinite(cost_coefficient):
            self.c = max(cost_coefficient, 0.0)
        if math.isfinite(verify_slope):
            self.slope = max(verify_slope, 0.0)

    def speculate(self) -> bool:
        """Draft on this step?"""
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        return True

    def record(self, num_drafted: int, num_draft_forwards: int, num_emitted: int) -> None:
        """One speculative step: drafts verified, draft forwards made, tokens emitted (>= 1)."""
        v = (num_drafted, num_draft_forwards, max(num_emitted, 1))
        d = self.decay
        self._weights = d * self._weights + 1
        self._squared_weights = d * d * self._squared_weights + 1
        for i in range(3):
            self._sum[i] = d * self._sum[i] + v[i]
            for j in range(3):
                self._sum_products[i][j] = d * self._sum_products[i][j] + v[i] * v[j]
        self.num_speculative_steps += 1
        gain, error = self.gain()
        if self.num_speculative_steps >= self.warmup and gain < -self.margin * error:
            self.paused_for = self.probe_every
            self.num_pauses += 1

    def gain(self) -> tuple[float, float]:
        """A speculative step's mean gain over a plain one, tokens emitted − cost in target steps
        (> 0: speculation pays), and its standard error, from the weighted steps recorded."""
        w = (-self.slope, -self.c, 1.0)  # gain = w · v − (1 + base)
        mean = [s / self._weights for s in self._sum]
        var = sum(w[i] * w[j] * (self._sum_products[i][j] / self._weights - mean[i] * mean[j])
                  for i in range(3) for j in range(3))
        effective_steps = self._weights ** 2 / self._squared_weights
        error = (max(var, 0.0) / max(effective_steps - 1, 1.0)) ** 0.5
        return sum(wi * m for wi, m in zip(w, mean)) - 1 - self.base, error

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
