"""How many drafts pay for the whole batch this step? (Cor. 3.9 and Thm 3.8 for a batch, from
the loop's own timings.)

The paper's speedup assumes spare compute: verifying k+1 tokens costs about one step (§3.3). A
batch spends that compute on other rows: with B rows a verify reads B·(k+1) tokens where a plain
step reads B, and on a CPU the target's forward time grows with the tokens it reads once they
fill the matrix units. Per-row guards (engine.guard) cannot see that, so with two or more guarded
rows the engine caps every row's γ at the k that maximizes the batch's expected tokens per second:

    k* = argmax_k  Σ_b E(α_b, min(k, k_b)) / (T(B·(k+1)) + k·D(B)),   E(α, k) = (1 − α^{k+1}) / (1 − α)

(k = 0 is a plain step: B tokens in T(B)). E is paper Eq. 1 with row b's measured α̂ (the batch's
mean for a row without one yet); T(n) is the target's forward time for n fed tokens and D(r) a
draft forward's time for r rows, both fitted online to the loop's own measurements (least
squares on a line, older observations fading). The first steps draft as planned; once a few
verify steps are timed, one plain step is taken to time that kind too; while capped, one step in
`probe_every` is a probe: one row drafts up to `probe_gamma` tokens, so the estimates stay fresh
(the verify is as wide for the batch as if every row drafted, and the draft forward as long) at
the price of one row's prompt read by the draft, not every row's; each probe that changes nothing
doubles that interval (up to `max_probe_every`).

A row whose draft has not read its committed tokens (a new row's prompt, or tokens committed
while it did not draft) must read them before it drafts: a one-off R(u) seconds for u tokens
(0.1-0.4 s for a HumanEval prompt and the default pair), fitted like T and D. A step that starts a
row drafting is charged R(u_b) · E_b / left_b, the read spread over the row's remaining steps
(left_b tokens at E_b per step). Drafting must also beat plain steps by `margin`, for the costs
the line still leaves out (sampling work per drafted token, the padding of catch-up reads): at
8 rows on 2 cores the model without both rated γ = 2 at 1.02x a plain step where the loop
measured 0.93x (2026-12-01).

Exactness: γ is chosen before the step's drafts and draws, from past timings and tokens only, so
each step still samples exactly from p (§2.3). Only guarded rows (greedy and unseeded requests)
are ever capped, so a seeded request's output still never depends on its batch (docs/exactness.md rule 7).
"""

from __future__ import annotations

from specdecode import analysis


class LineFit:
    """y ≈ a + b·x by least squares, each observation's weight fading by `decay` per new one."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def predict(self, x: float) -> float | None:
        """None until there are observations; a flat line while every x was the same."""
        if self.n == 0:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            return mean_y
        slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / var)
        return max(1e-9, mean_y + slope * (x - mean_x))


PRIOR_ALPHA = 0.8  # α for rows without a measurement while no row has one (optimistic: draft, then measure)


def expected_tokens(alpha: float, k: int) -> float:
    """Paper Eq. 1 (specdecode.analysis.expected_tokens) for k >= 0 drafts, α̂ clipped to [0, 1]:
    k = 0 is a plain step (one token)."""
    return 1.0 if k == 0 else analysis.expected_tokens(min(max(alpha, 0.0), 1.0), k)


class BatchCostModel:
    """The target's and the draft's forward times, fitted to the loop's measurements, and the
    batch's γ cap of the module docstring.

    Args:
        probe_every: while capped, probe on one step in this many at first (>= 1).
        max_probe_every: the longest interval between probes.
        probe_gamma: the most drafts of a probe's one row.
        margin: how much more tokens per second drafting must promise than plain steps.
    Attributes:
        probing: whether the last gamma_cap was a probe (one row drafts, up to the cap).
    """

    def __init__(self, probe_every: int = 16, max_probe_every: int = 256, probe_gamma: int = 3,
                 margin: float = 0.25):
        self.target = LineFit()   # seconds of a target forward vs tokens fed (padding included)
        self.draft = LineFit()    # seconds of a draft forward vs rows fed
        self.read = LineFit()     # seconds of the draft reading committed tokens vs their number
        self.widths: set[int] = set()  # feed widths seen: a plain step is 1, a verify k+1 (as 2)
        self.verify_steps = 0
        self.min_probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_every = probe_every
        self.probe_gamma, self.margin = probe_gamma, margin
        self.capped_steps = 0
        self.probing = False

    def observe_target(self, tokens_fed: int, width: int, seconds: float) -> None:
        self.target.add(tokens_fed, seconds)
        self.widths.add(min(width, 2))
        self.verify_steps += width > 1

    def observe_draft(self, forwards: int, rows: int, seconds: float) -> None:
        if forwards:
            self.draft.add(rows, seconds / forwards)

    def observe_read(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.read.add(tokens, seconds)

    def guard_costs(self, rows: int, k: int) -> tuple[float, float] | None:
        """(c, verify slope) in target calls for a row's guard (engine.guard) at this batch size
        and γ = k, from the loop's timings; None until a plain step, a verify step and a draft
        forward have been timed."""
        plain = self.target.predict(rows) if 1 in self.widths and 2 in self.widths else None
        draft_s = self.draft.predict(rows)
        if plain is None or draft_s is None or k < 1:
            return None
        return draft_s / plain, max(self.target.predict(rows * (k + 1)) / plain - 1, 0.0) / k

    def gamma_cap(self, planned: list[int], alphas: list[float | None], unread: list[int] | None = None,
                  left: list[int] | None = None) -> int:
        """The most drafts any row may make this step (max(planned) when nothing is capped).

        Args:
            planned: each row's γ from its own policy.  alphas: each row's α̂ (None: not measured).
            unread: each row's committed tokens its draft has not read (None: reads are free).
            left: each row's tokens still to generate (with unread).
        """
        k_max = max(planned)
        self.probing = False
        if 2 not in self.widths:  # no verify step timed yet
            return k_max
        if 1 not in self.widths:  # time one plain step, once the verify steps' time is known
            return k_max if self.verify_steps < 3 else 0
        known = [a for a in alphas if a is not None]
        prior = sum(known) / len(known) if known else PRIOR_ALPHA
        alphas = [prior if a is None else a for a in alphas]
        rows = len(planned)
        draft_s = self.draft.predict(rows) or 0.0

        def rate(k: int) -> float:
            per_row = [expected_tokens(a, min(k, p)) for a, p in zip(alphas, planned)]
            seconds = self.target.predict(rows * (k + 1)) + k * draft_s
            if k and unread is not None:
                seconds += sum((self.read.predict(u) or 0.0) * e / max(n, 1)
                               for u, n, e, p in zip(unread, left, per_row, planned) if u > 2 and p)
            return sum(per_row) / seconds

        best = max(range(k_max + 1), key=rate)
        if rate(best) < (1 + self.margin) * rate(0):
            best = 0
        if best == k_max:
            self.capped_steps, self.probe_every = 0, self.min_probe_every
            return k_max
        self.capped_steps += 1
        if self.capped_steps >= self.probe_every:
            self.capped_steps = 0
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            self.probing = True
            return min(k_max, self.probe_gamma)
        return best
