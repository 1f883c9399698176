"""Choosing the configuration from this machine's costs (paper Eq. 1 and Thm 3.8 with a measured
verify cost), not from the machine the defaults were tuned on.

The paper's speedup (1 − α^{γ+1}) / ((1 − α)(γc + 1)) assumes that scoring γ+1 tokens costs one
target step (§3.3). On a CPU that holds only where the multi-row product has a fast kernel: with
native bfloat16 (AVX-512-BF16, AMX) a 9-token verify costs about one step, without it (AVX2-only
x86: AMD Zen 2/3, Intel before Sapphire Rapids) four to six, and float32 with packed weights about
1.4 (docs/auto-configuration.md). So each candidate target kernel is timed for its one-token step T, its
k-token cost r(k)·T and its prompt read per token R, each draft kernel and dtype for its step D
and its own prompt read (any draft goes with any target: the verifier needs only its q). A
configuration's rate for a planned request, P prompt tokens then N new ones, is

    rate(α, γ) = N / (P · (R + R_draft) + N · (T · r(γ+1) + γ · D) / E(α, γ)),
    E(α, γ) = (1 − α^{γ+1}) / (1 − α)   (paper Eq. 1).

For each kernel pair γ_max is the largest γ whose rate at PRIOR_ALPHA is within GAMMA_TOLERANCE of
its best, and the pair's score the geometric mean of its rate at PRIOR_ALPHA with that γ and its
best rate at LOW_ALPHA with a γ up to it (the draft's confidence stop shortens blocks where drafts
are often wrong). The chooser takes the pair with the best score, or plain decoding (rate N / (P · R + N · T),
the fastest target kernel) unless a pair beats it by MARGIN. Pure: numbers in, a Choice out (tests give it cost tables of
several CPU classes and of a GPU).
"""

from __future__ import annotations

import math
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
# The choice plans for a low acceptance too, weighed as much as PRIOR_ALPHA (the geometric mean of
# the two rates): the kernels are fixed at load, and a configuration that wins only where drafts
# are right often can lose badly elsewhere (on an emulated AVX2 CPU a float32 target verifying
# cheaply gave 1.55x on a HumanEval prompt and 0.62x on a Spec-Bench qa prompt against bfloat16
# plain decoding; Spec-Bench's categories measure α̂ 0.55-0.77, docs/results/alpha_int4.md).
LOW_ALPHA = 0.6
# Speculation is taken only where its score beats plain decoding's by this much: Eq. 1 leaves out
# what each step costs beside the forwards (sampling and verifying per drafted token, the Python
# loop, the draft's prompt read at a row's second step). The llama.cpp Q4_K_M target with the int4
# draft was rated 1.07x plain and measured 0.96x on HumanEval (docs/results/vs_llamacpp_plain_floor.md).
MARGIN = 0.10
# A batch-invariant target kernel (its verify and its plain step round alike, so speculative output
# equals plain output bit for bit: specdecode.models.invariant) is taken over faster ones that
# score less than this fraction above it.
INVARIANT_TOLERANCE = 0.05


def is_invariant(kernel: str) -> bool:
    """Whether a target kernel's name says it is batch-invariant (TargetKernel.batch_invariant)."""
    return kernel.endswith("-invariant")


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
    c: the draft step over the chosen target step (paper Def. 3.7).  r, r2: r(γ+1) and r(2) of that
    kernel (for plain decoding r(γ_max+1): its free drafts' verifies).
    alpha: the α planned for.  low_alpha: the low α weighed as much (LOW_ALPHA).  notes: what was
    measured, one line per target kernel.  guard_costs(γ_max): the guard's starting costs from
    these timings (no second measurement at load).  prior: not timed here (tune.prior).
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
    low_alpha: float = LOW_ALPHA
    notes: tuple[str, ...] = field(default_factory=tuple)
    draft_timed: bool = True  # False: no draft model was given, only target kernels were compared
    r2: float = 0.0  # r(2) of the chosen kernel (0: not recorded); with c and r, the guard's costs
    provisional: bool = False  # timed beside other work: used and cached, timed again on an idle start
    prior: bool = False  # not timed here: the prior for this CPU class (tune.prior; notes say where from)

    def guard_costs(self, gamma: int) -> tuple[float, float, float] | None:
        """(c, slope, base) for the guard from the chosen kernels' timings (tune.timing.verify_line),
        or None where they do not say (a choice cached before r(2) was kept). gamma: the decoder's
        γ_max, for plain decoding's free drafts (c = 0: they cost no forward; r is then the target's
        r(γ_max + 1), as the choice was made for that γ_max)."""
        from specdecode.tune.timing import verify_line

        if self.r2 <= 0:
            return None
        if self.draft_kernel is None:
            return (0.0, *verify_line(self.r2, self.r, gamma))
        return (self.c, *verify_line(self.r2, self.r, self.gamma))

    @property
    def speedup(self) -> float:
        """Expected tokens per second over plain decoding with the fastest target kernel."""
        return self.rate / self.plain_rate

    def headline(self) -> str:
        """The choice in one short line for a progress message (describe() has the numbers)."""
        if self.draft_kernel is None:
            what = f"{self.target_kernel} target" + (", plain decoding: no draft model pays here" if self.draft_timed
                                                      else "")
        else:
            what = (f"{self.target_kernel} target, {self.draft_kernel} {self.draft_dtype} draft, γ ≤ {self.gamma}, "
                    f"expected {self.speedup:.2f}x plain decoding")
        if self.prior:
            return f"{what} (the measured prior for this CPU class; `specdecode tune` times this machine)"
        return f"{what} (timed beside other work: provisional)" if self.provisional else what

    def describe(self) -> str:
        if self.draft_kernel is None and not self.draft_timed:
            return f"{self.target_kernel} target ({self.plain_rate:.1f} tokens/s expected): the fastest target kernel here"
        if self.draft_kernel is None:
            return (f"{self.target_kernel} target, plain decoding ({self.plain_rate:.1f} tokens/s expected): no draft "
                    "model pays on this machine, so none runs (free drafts still do; a torch dtype such as "
                    "dtype='bfloat16' skips this choice)")
        return (f"{self.target_kernel} target, {self.draft_kernel} {self.draft_dtype} draft, γ ≤ {self.gamma}: "
                f"c = {self.c:.2f}, "
                f"r(γ+1) = {self.r:.2f}, expected {self.speedup:.2f}x plain decoding at α = {self.alpha:.2f} "
                f"(weighed with α = {self.low_alpha:.2f})" + (f"; {self.notes[0]}" if self.prior and self.notes else ""))


def choose(targets: dict[str, TargetCost], drafts: dict[tuple[str, str], DraftCost], alpha: float = PRIOR_ALPHA,
           max_gamma: int = 8, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
           low_alpha: float = LOW_ALPHA, allow_plain: bool = True) -> Choice:
    """The configuration with the best score over a request of prompt_tokens prompt tokens and
    new_tokens new ones (its prompt read included): the geometric mean of its expected tokens per
    second at alpha and at low_alpha. Speculation must beat plain decoding's score by MARGIN.

    Args:
        targets: {target kernel: its TargetCost}.
        drafts: {(draft kernel, draft dtype kernel): its DraftCost}; empty for no draft. Any
            draft goes with any target kernel.
        alpha, low_alpha: the acceptance rates planned for, in [0, 1).  max_gamma: the largest γ
            considered.  prompt_tokens, new_tokens: the request planned for (>= 0 and >= 1).
        allow_plain: False keeps speculation where a draft was timed (timings taken beside other
            work can make any draft look dear; only an idle measurement may turn it off).
    Returns:
        a Choice; draft_kernel None (plain decoding) where no draft pays on this machine. Its
        rate is the expected tokens per second at alpha.
    Raises:
        ValueError: no target kernel, an alpha outside [0, 1), max_gamma < 1, prompt_tokens < 0
            or new_tokens < 1.
    """
    if not targets:
        raise ValueError("choose() needs at least one target kernel's costs")
    if not (0 <= alpha < 1 and 0 <= low_alpha < 1):
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r} and {low_alpha!r}")
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma!r}")
    if prompt_tokens < 0 or new_tokens < 1:
        raise ValueError(f"need prompt_tokens >= 0 and new_tokens >= 1, got {prompt_tokens!r}, {new_tokens!r}")

    def request_rate(read_s_per_token: float, decode_rate: float) -> float:
        # a request's tokens per second, its prompt reads included
        return new_tokens / (prompt_tokens * read_s_per_token + new_tokens / decode_rate)

    plain = {kernel: request_rate(cost.read_s_per_token, 1 / cost.step_s) for kernel, cost in targets.items()}
    plain_kernel = max(plain, key=plain.get)
    # (score, Choice) of the best configuration overall and of the best on an invariant kernel
    # plain decoding keeps its kernel's r(2) and r(γ_max + 1): the guard of free drafts prices
    # their verifies with them (guard_costs) instead of timing the target again at load
    scored = [((1 + MARGIN) * plain[kernel], Choice(kernel, None, None, 0, plain[kernel], plain[plain_kernel],
                                                    r=cost.ratio(max_gamma + 1), alpha=alpha, low_alpha=low_alpha,
                                                    draft_timed=bool(drafts), r2=cost.ratio(2)))
              for kernel, cost in targets.items()]
    for kernel, cost in targets.items():
        for (draft_kernel, draft_dtype), draft in drafts.items():
            read = cost.read_s_per_token + draft.read_s_per_token

            def rate(a: float, gamma: int) -> float:
                step = cost.step_s * cost.ratio(gamma + 1) + gamma * draft.step_s
                return request_rate(read, expected_tokens(a, gamma) / step)

            # γ_max for the α planned for; where drafts are often wrong the confidence stop ends
            # blocks early, so the low α is priced at its own best γ up to γ_max
            rates = {gamma: rate(alpha, gamma) for gamma in range(1, max_gamma + 1)}
            top = max(rates.values())
            gamma = max(g for g, r in rates.items() if r >= (1 - GAMMA_TOLERANCE) * top)
            score = math.sqrt(rates[gamma] * max(rate(low_alpha, g) for g in range(1, gamma + 1)))
            scored.append((score, Choice(kernel, draft_kernel, draft_dtype, gamma, rate(alpha, gamma),
                                         plain[plain_kernel], draft.step_s / cost.step_s, cost.ratio(gamma + 1),
                                         alpha, low_alpha, r2=cost.ratio(2))))
    if not allow_plain and len(scored) > len(targets):
        scored = scored[len(targets):]
    # the first of equal scores wins: plain decoding before speculation, kernels in the order given
    best_score, best = max(scored, key=lambda pair: pair[0])
    # (of the same kind as the best: the preference never turns speculation on or off)
    invariant = [pair for pair in scored if is_invariant(pair[1].target_kernel)
                 and (pair[1].draft_kernel is None) == (best.draft_kernel is None)]
    if invariant:
        score, choice = max(invariant, key=lambda pair: pair[0])
        if score >= (1 - INVARIANT_TOLERANCE) * best_score:
            return choice
    return best
