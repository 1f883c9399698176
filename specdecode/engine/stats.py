"""Per-request statistics (docs/api.md, statistics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """What one generation did (docs/api.md, statistics). Times in seconds."""

    num_target_calls: int = 0
    num_draft_calls: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_rejected: int = 0  # blocks that ended in a rejection (a verified draft not accepted)
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated: int = 0
    wall_time_s: float = 0.0
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    lossy: bool = False
    batch_invariant: bool = False  # the target computed its logits on batch-invariant kernels
    # the same request (seed included) gives the same tokens whatever runs beside it and whatever was
    # drafted: batch-invariant logits, and greedy or drafter-invariant verification with a seed
    repeatable: bool = False
    num_lookup_steps: int = 0    # steps whose drafts were copied by prompt lookup
    num_guard_pauses: int = 0    # times the guard paused drafting (engine.guard)
    num_free_declined: int = 0   # free drafts the guard priced out of a step (engine.guard)
    num_batch_caps: int = 0      # steps whose γ the batch's cost lowered (engine.cost)
    num_tree_branch_wins: int = 0  # token-tree steps whose accepted path left the draft's chain

    def record_step(self, k: int, n: int, emitted: int) -> None:
        """One verify step: k drafted, n accepted, `emitted` tokens of the block returned. A stop
        on an accepted draft ends the block there: the drafts after it are not counted (rule 4)."""
        kept = min(n, emitted)
        self.num_drafted += emitted if emitted <= n else k
        self.num_accepted += kept
        self.num_rejected += int(n < k and emitted > n)
        for i in range(kept):
            self.accepted_per_position[i] += 1

    def snapshot(self) -> "GenerationStats":
        """A copy that later steps do not change."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @classmethod
    def combine(cls, parts: list["GenerationStats"]) -> "GenerationStats":
        """The stats of several generations decoded together (a request's n choices): counts
        and times summed, wall time the longest, accepted_per_position summed per position.
        One generation's are returned as they are."""
        if len(parts) == 1:
            return parts[0]
        total = cls(accepted_per_position=[0] * max((len(p.accepted_per_position) for p in parts), default=0))
        for part in parts:
            for f in dataclasses.fields(cls):
                value = getattr(part, f.name)
                if f.name == "accepted_per_position":
                    for i, count in enumerate(value):
                        total.accepted_per_position[i] += count
                elif f.name == "wall_time_s":
                    total.wall_time_s = max(total.wall_time_s, value)
                elif f.name == "lossy":
                    total.lossy = total.lossy or value
                elif f.name in ("batch_invariant", "repeatable"):
                    setattr(total, f.name, all(getattr(p, f.name) for p in parts))
                else:
                    setattr(total, f.name, getattr(total, f.name) + value)
        return total

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (the empirical α); NaN when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else float("nan")

    @property
    def alpha_estimate(self) -> float:
        """Accepted / (accepted + rejected): the fraction of verified drafts that were accepted,
        the per-token acceptance probability α of paper Def. 3.1 (drafts after a rejection were
        never verified, so accepted / drafted underestimates α: at α = 0.8 and γ = 4 it gives
        0.59). NaN when nothing was verified."""
        verified = self.num_accepted + self.num_rejected
        return self.num_accepted / verified if verified else float("nan")

    @property
    def mean_tokens_per_call(self) -> float:
        """Emitted tokens per target call; Eq. 1 of the paper predicts it (1.0 for plain decoding)."""
        return self.num_generated / self.num_target_calls if self.num_target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.wall_time_s if self.wall_time_s else 0.0

    def to_dict(self) -> dict:
        return {
            "num_target_calls": self.num_target_calls, "num_draft_calls": self.num_draft_calls,
            "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
            "num_rejected": self.num_rejected,
            "acceptance_rate": None if not self.num_drafted else self.acceptance_rate,
            "alpha_estimate": None if not self.num_accepted + self.num_rejected else self.alpha_estimate,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_tokens_per_call": self.mean_tokens_per_call, "num_generated": self.num_generated,
            "wall_time_s": self.wall_time_s, "time_draft_s": self.time_draft_s,
            "time_target_s": self.time_target_s, "tokens_per_second": self.tokens_per_second,
            "lossy": self.lossy, "batch_invariant": self.batch_invariant, "repeatable": self.repeatable,
            "num_lookup_steps": self.num_lookup_steps,
            "num_guard_pauses": self.num_guard_pauses, "num_free_declined": self.num_free_declined,
            "num_batch_caps": self.num_batch_caps,
            "num_tree_branch_wins": self.num_tree_branch_wins,
        }
