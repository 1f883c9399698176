"""Choosing the configuration from this machine's costs (paper Eq. 1 and Thm 3.8 with a measured
verify cost), not from the machine the defaults were tuned on.

The paper's speedup (1 − α^{γ+1}) / ((1 − α)(γc + 1)) assumes that scoring γ+1 tokens costs one
target step (§3.3). On a CPU that holds only where the multi-row product has a fast kernel: with
native bfloat16 (AVX-512-BF16, AMX) a 9-token verify costs about one step, without it (AVX2-only
x86: AMD Zen 2/3, Intel before Sapphire Rapids) about four, and float32 with packed weights about
1.4 (docs/hardware.md). So each candidate target kernel is timed for its one-token step T and its
k-token cost r(k)·T, each draft kernel for its step D, and the chooser maximizes the expected
tokens per second

    rate(kernel, draft, γ) = E(α, γ) / (T · r(γ+1) + γ · D),   E(α, γ) = (1 − α^{γ+1}) / (1 − α)

over target kernels and draft kernels, against plain decoding (1 / T) with the fastest target
kernel; γ_max is then the largest γ within GAMMA_TOLERANCE of that kernel pair's best rate. Pure: numbers in, a Choice out (tests give it cost tables of both CPU
classes and of a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.engine.cost import expected_tokens

# The acceptance the choice assumes before any request ran: the default pair's α̂ of verified
# drafts with its int4 draft and confidence stop is 0.90 (code, T=0) and 0.85 (code, T=1), 0.55-0.77
# on translation and summarization (docs/alpha_int4.md); a lower α only lowers γ.
PRIOR_ALPHA = 0.85
# γ_max is the largest γ whose expected rate is within this fraction of the best: the draft's
# confidence stop ends most blocks before γ_max, so a larger cap costs little where the verify is
# flat, while Eq. 1's i.i.d. α understates runs of acceptances (paper A.3).
GAMMA_TOLERANCE = 0.05


@dataclass(frozen=True)
class TargetCost:
    """One target kernel (a dtype and how its products run) on this machine.

    step_s: seconds of a one-token step.  r: {k: seconds of a k-token call / step_s} for the
    measured k (at least k = 2); r(k) between them is interpolated, beyond them extrapolated on
    the last segment.  read_s_per_token: seconds per token of a long prompt read."""

    step_s: float
    r: dict[int, float]
    read_s_per_token: float

    def ratio(self, k: int) -> float:
        """r(k), with r(1) = 1 (piecewise linear through the measured points)."""
        points = sorted({1: 1.0, **self.r}.items())
        for (k0, r0), (k1, r1) in zip(points, points[1:]):
            if k <= k1:
                return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
        (k0, r0), (k1, r1) = points[-2], points[-1]
        return r1 + (r1 - r0) * (k - k1) / (k1 - k0)


@dataclass(frozen=True)
class Choice:
    """What the chooser picked and why.

    target_kernel: a key of the target costs ("bfloat16", "float32-packed", ...).
    draft_kernel: a key of the draft costs ("int4", "int8", "none"), or None for plain decoding.
    gamma: γ_max (0 for plain decoding).  rate: expected tokens per second.
    plain_rate: tokens per second of plain decoding with the fastest target kernel.
    c: the draft step over the chosen target step (paper Def. 3.7).  r: r(γ+1) of that kernel.
    """

    target_kernel: str
    draft_kernel: str | None
    gamma: int
    rate: float
    plain_rate: float
    c: float = 0.0
    r: float = 1.0
    alpha: float = PRIOR_ALPHA
    verification: str = "token"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def speedup(self) -> float:
        """Expected tokens per second over plain decoding with the fastest target kernel."""
        return self.rate / self.plain_rate

    def describe(self) -> str:
        if self.draft_kernel is None:
            return f"{self.target_kernel} target, plain decoding ({self.plain_rate:.1f} tokens/s expected)"
        return (f"{self.target_kernel} target, {self.draft_kernel} draft, γ ≤ {self.gamma}: c = {self.c:.2f}, "
                f"r(γ+1) = {self.r:.2f}, expected {self.speedup:.2f}x plain decoding at α = {self.alpha:.2f}")


def choose(targets: dict[str, TargetCost], drafts: dict[str, dict[str, float]], alpha: float = PRIOR_ALPHA,
           max_gamma: int = 8) -> Choice:
    """The configuration with the most expected tokens per second.

    Args:
        targets: {target kernel: its TargetCost}.
        drafts: {target kernel: {draft kernel: seconds of one draft step}} (a draft runs in the
            target kernel's dtype, so its costs are per target kernel); empty for no draft.
        alpha: the acceptance rate to plan for, in [0, 1).  max_gamma: the largest γ considered.
    Returns:
        a Choice; draft_kernel None (plain decoding) where no draft pays on this machine.
    Raises:
        ValueError: no target kernel, alpha outside [0, 1), max_gamma < 1.
    """
    if not targets:
        raise ValueError("choose() needs at least one target kernel's costs")
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma!r}")
    plain_kernel = min(targets, key=lambda name: targets[name].step_s)
    plain_rate = 1 / targets[plain_kernel].step_s
    best = Choice(plain_kernel, None, 0, plain_rate, plain_rate, alpha=alpha)
    for kernel, cost in targets.items():
        for draft_kernel, draft_s in drafts.get(kernel, {}).items():
            rates = {gamma: expected_tokens(alpha, gamma) / (cost.step_s * cost.ratio(gamma + 1) + gamma * draft_s)
                     for gamma in range(1, max_gamma + 1)}
            top = max(rates.values())
            if top > best.rate:
                gamma = max(g for g, rate in rates.items() if rate >= (1 - GAMMA_TOLERANCE) * top)
                best = Choice(kernel, draft_kernel, gamma, rates[gamma], plain_rate, draft_s / cost.step_s,
                              cost.ratio(gamma + 1), alpha)
    return best
