"""Choosing the configuration from this machine's costs (paper Eq. 1 and Thm 3.8 with a measured
verify cost), not from the machine the defaults were tuned on.

The paper's speedup (1 − α^{γ+1}) / ((1 − α)(γc + 1)) assumes that scoring γ+1 tokens costs one
target step (§3.3). On a CPU that holds only where the multi-row product has a fast kernel: with
native bfloat16 (AVX-512-BF16, AMX) a 9-token verify costs about one step, without it (AVX2-only
x86: AMD Zen 2/3, Intel before Sapphire Rapids) four to six, and float32 with packed weights about
1.4 (docs/auto-configuration.md). So each candidate target kernel is timed for its one-token step T, its
k-token cost r(k)·T and its prompt read per token R, each draft kernel and dtype for its step D
and its own prompt read (any draft goes with any target: the verifier needs only its q). For each
kernel pair γ_max is the largest γ within GAMMA_TOLERANCE of the best decoding rate

    rate(kernel, draft, γ) = E(α, γ) / (T · r(γ+1) + γ · D),   E(α, γ) = (1 − α^{γ+1}) / (1 − α),

and the chooser takes the pair (or plain decoding, rate 1 / T, with any target kernel) whose
planned request, P prompt tokens then N new ones, has the most tokens per second:
N / (P · (R + R_draft) + N / rate), among target kernels whose own plain decoding of that request
is within PLAIN_FLOOR of the best one's (the guard's fallback where α turns out low). Pure: numbers in, a Choice out (tests give it cost tables of both CPU
classes and of a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.analysis import expected_tokens

# The acceptance the choice assumes before any request ran: the default pair's α̂ of verified
# drafts with its int4 draft and confidence stop is 0.90 (code, T=0) and 0.85 (code, T=1), 0.55-0.77
# on translation and summarization (docs/results/alpha_int4.md); a lower α only lowers γ.
PRIOR_ALPHA = 0.85
# γ_max is the largest γ whose expected rate is within this fraction of the best: the draft's
# confidence stop ends most blocks before γ_max, so a larger cap costs little where the verify is
# flat, while Eq. 1's i.i.d. α understates runs of acceptances (paper A.3).
GAMMA_TOLERANCE = 0.05
# The request the choice plans for: a HumanEval prompt (~130-180 tokens with its chat template)
# and 128 new tokens. Prompt reads weigh in because a kernel that is fast one row at a time can
# read a prompt several times slower (bfloat16 without native support: 82 against 22 ms a token).
PROMPT_TOKENS, NEW_TOKENS = 150, 128
# A target kernel whose plain decoding (of that request) is slower than this fraction of the best
# one's is not taken: the dtype is fixed at load, and where acceptance turns out low the guard
# falls back to plain steps of the chosen kernel, which would then lose to the target alone (on an
# emulated AVX2 CPU a float32 target verifying cheaply gave 1.55x on a HumanEval prompt and 0.62x
# on a Spec-Bench qa prompt against bfloat16 plain decoding, docs/auto-configuration.md).
PLAIN_FLOOR = 0.9


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
class DraftCost:
    """One draft kernel and dtype on this machine: seconds of a one-token draft step, and per token
    of its prompt read (the draft reads each request's prompt once, on the request's second step)."""

    step_s: float
    read_s_per_token: float = 0.0


@dataclass(frozen=True)
class Choice:
    """What the chooser picked and why.

    target_kernel: a key of the target costs ("bfloat16", "float32-packed", ...).
    draft_kernel, draft_dtype: the key of the draft costs chosen (its layers: "int4", "int8",
        "none"; its dtype's kernel: "bfloat16", "bfloat16-gemv", "float32"), or None for plain
        decoding. The draft's dtype is free: the verifier needs only the q it sampled from.
    gamma: γ_max (0 for plain decoding).  rate: expected tokens per second of the planned request
    (prompt read included).  plain_rate: the same for plain decoding with the best target kernel.
    c: the draft step over the chosen target step (paper Def. 3.7).  r: r(γ+1) of that kernel.
    alpha: the α planned for.  notes: what was measured, one line per target kernel.
    The verification rule is not chosen: block verification equals the token-wise rule under
    greedy decoding, costs the same target call, and measured level with it at temperature 1
    (2.59x against 2.61x, docs/results/bench_code_t1_20.md); Eq. 1 has no term for its gain.
    """

    target_kernel: str
    draft_kernel: str | None
    draft_dtype: str | None
    gamma: int
    rate: float
    plain_rate: float
    c: float = 0.0
    r: float = 1.0
    alpha: float = PRIOR_ALPHA
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def speedup(self) -> float:
        """Expected tokens per second over plain decoding with the fastest target kernel."""
        return self.rate / self.plain_rate

    def describe(self) -> str:
        if self.draft_kernel is None:
            return (f"{self.target_kernel} target, plain decoding ({self.plain_rate:.1f} tokens/s expected): no draft "
                    "pays on this machine, so none runs (an explicit dtype= skips this choice)")
        return (f"{self.target_kernel} target, {self.draft_kernel} {self.draft_dtype} draft, γ ≤ {self.gamma}: "
                f"c = {self.c:.2f}, "
                f"r(γ+1) = {self.r:.2f}, expected {self.speedup:.2f}x plain decoding at α = {self.alpha:.2f}")


def choose(targets: dict[str, TargetCost], drafts: dict[tuple[str, str], DraftCost], alpha: float = PRIOR_ALPHA,
           max_gamma: int = 8, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS) -> Choice:
    """The configuration with the most expected tokens per second over a request of
    prompt_tokens prompt tokens and new_tokens new ones (its prompt read included).

    Args:
        targets: {target kernel: its TargetCost}.
        drafts: {(draft kernel, draft dtype kernel): its DraftCost}; empty for no draft. Any
            draft goes with any target kernel.
        alpha: the acceptance rate to plan for, in [0, 1).  max_gamma: the largest γ considered.
        prompt_tokens, new_tokens: the request planned for (>= 0 and >= 1).
    Returns:
        a Choice; draft_kernel None (plain decoding) where no draft pays on this machine.
    Raises:
        ValueError: no target kernel, alpha outside [0, 1), max_gamma < 1, prompt_tokens < 0
            or new_tokens < 1.
    """
    if not targets:
        raise ValueError("choose() needs at least one target kernel's costs")
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma!r}")
    if prompt_tokens < 0 or new_tokens < 1:
        raise ValueError(f"need prompt_tokens >= 0 and new_tokens >= 1, got {prompt_tokens!r}, {new_tokens!r}")
    def request_rate(read_s_per_token: float, decode_rate: float) -> float:
        # a request's tokens per second, its prompt reads included
        return new_tokens / (prompt_tokens * read_s_per_token + new_tokens / decode_rate)

    plain = {kernel: request_rate(cost.read_s_per_token, 1 / cost.step_s) for kernel, cost in targets.items()}
    plain_kernel = max(plain, key=plain.get)
    best = Choice(plain_kernel, None, None, 0, plain[plain_kernel], plain[plain_kernel], alpha=alpha)
    for kernel, cost in targets.items():
        if plain[kernel] < PLAIN_FLOOR * best.plain_rate:
            continue
        for (draft_kernel, draft_dtype), draft in drafts.items():
            rates = {gamma: expected_tokens(alpha, gamma) / (cost.step_s * cost.ratio(gamma + 1)
                                                             + gamma * draft.step_s)
                     for gamma in range(1, max_gamma + 1)}
            top = max(rates.values())
            gamma = max(g for g, rate in rates.items() if rate >= (1 - GAMMA_TOLERANCE) * top)
            rate = request_rate(cost.read_s_per_token + draft.read_s_per_token, rates[gamma])
            if rate > best.rate:
                best = Choice(kernel, draft_kernel, draft_dtype, gamma, rate, best.plain_rate,
                              draft.step_s / cost.step_s, cost.ratio(gamma + 1), alpha)
    return best
