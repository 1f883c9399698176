"""Does speculation pay for the whole batch this step? (Cor. 3.9 for a batch, from the loop's own
timings.)

The paper's speedup assumes spare compute: verifying k+1 tokens costs about one step (§3.3). A
batch spends that compute on other rows: with B rows a verify reads B·(k+1) tokens where a plain
step reads B, and on a CPU the target's forward time grows with the tokens it reads once they
fill the matrix units. Per-row guards (engine.guard) cannot see that, so the engine also asks
this model, each step with two or more guarded rows:

    speculate  ⇔  Σ_b E_b / (T(B·(k+1)) + F·D(B))  >  B / T(B)

E_b is row b's running average of tokens per speculative step (its guard's), T(n) the target's
forward time for n fed tokens and D(r) a draft forward's time for r rows, both fitted online to
the loop's own measurements (least squares on a line, older observations fading), F the draft
forwards the plan needs. The first steps speculate; once a few verify steps are timed, one plain
step is taken to time that kind too; and while paused, one step in `probe_every` speculates, so
both estimates stay fresh.

Exactness: the choice of γ (here 0 or the rows' plans) is made before the step's drafts and
draws, from past timings and tokens only, so each step still samples exactly from p (§2.3).
Only guarded rows (greedy and unseeded requests) are ever paused, so a seeded request's output
still never depends on its batch (DESIGN.md rule 7).
"""

from __future__ import annotations


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


class BatchCostModel:
    """The target's and the draft's forward times, fitted to the loop's measurements, and the
    batch decision of the module docstring.

    Args:
        probe_every: while paused, speculate on one step in this many (>= 1).
    """

    def __init__(self, probe_every: int = 16):
        self.target = LineFit()   # seconds of a target forward vs tokens fed (padding included)
        self.draft = LineFit()    # seconds of a draft forward vs rows fed
        self.widths: set[int] = set()  # feed widths seen: a plain step is 1, a verify k+1
        self.probe_every = probe_every
        self.paused_steps = 0
        self.num_pauses = 0

    def observe_target(self, tokens_fed: int, width: int, seconds: float) -> None:
        self.target.add(tokens_fed, seconds)
        self.widths.add(min(width, 2))

    def observe_draft(self, forwards: int, rows: int, seconds: float) -> None:
        if forwards:
            self.draft.add(rows, seconds / forwards)

    def speculate(self, rows: int, planned_width: int, draft_forwards: int, expected_tokens: float) -> bool:
        """Whether drafting this step yields more tokens per second than a plain step.

        Args:
            rows: B, the rows of this step.  planned_width: the widest feed if rows draft (k+1).
            draft_forwards: F.  expected_tokens: Σ_b E_b for the rows that would draft, plus one
                per row that would not.
        """
        if 2 not in self.widths:  # no verify step timed yet
            return True
        if 1 not in self.widths:  # time one plain step, once the verify steps' time is known
            return self.target.n < 3
        plain_s = self.target.predict(rows)
        spec_s = self.target.predict(rows * planned_width) + draft_forwards * (self.draft.predict(rows) or 0.0)
        if expected_tokens / spec_s > rows / plain_s:
            self.paused_steps = 0
            return True
        self.paused_steps += 1
        if self.paused_steps >= self.probe_every:
            self.paused_steps = 0
            return True
        self.num_pauses += 1
        return False
