"""Two proposers as one: free drafts first, a draft model for the rows they have nothing for.

Free drafts (prompt lookup, suffix drafts: paper §3.6) cost nothing but exist only where the
text repeats; a draft model costs a forward per token but always has a proposal. Composed, each
row takes the free draft where there is one, and the draft model serves the other rows in one
batched call, so a step costs at most one draft forward per position for the whole batch.
"""

from __future__ import annotations

from typing import Sequence

from specdecode.proposers.base import Draft, DraftRow, Proposer, proposer_reads


class FallbackProposer:
    """Proposes from `first` and, for the rows it gave an empty draft, from `then`.

    Both see every row: add_row, select and commit go to both, so `then` keeps each row's
    committed tokens (a draft model's cache catches up on the steps free drafts served). Which
    rows go to `then` depends only on `first`'s drafts, which depend on what it has seen, never
    on a row's random draws: every draft stays exact (paper §2.3), and a seeded row draws from its
    generator exactly as it would alone (docs/exactness.md rule 7).

    The timers are the sums of the parts' (`time_s`, and `read_s`, `read_tokens` as
    proposers.base.proposer_reads reads them; a part without them counts 0), and `unread()` the
    per-row sums of the parts that have one (None if neither has).

    Args:
        first: a proposer of free drafts (PromptLookupProposer, SuffixProposer).
        then: a proposer with a draft for every row (DraftModelProposer, CrossVocabProposer).
    Attributes:
        first, then: the parts (find_proposer looks through them).
        max_rows: the fewer of the parts' limits (None: no limit).
    """

    def __init__(self, first: Proposer, then: Proposer):
        self.first, self.then = first, then
        limits = [m for m in (getattr(first, "max_rows", None), getattr(then, "max_rows", None)) if m]
        self.max_rows = min(limits) if limits else None

    @property
    def time_s(self) -> float:
        return getattr(self.first, "time_s", 0.0) + getattr(self.then, "time_s", 0.0)

    @property
    def read_s(self) -> float:
        return proposer_reads(self.first)[0] + proposer_reads(self.then)[0]

    @property
    def read_tokens(self) -> int:
        return proposer_reads(self.first)[1] + proposer_reads(self.then)[1]

    def unread(self) -> list[int] | None:
        parts = [part.unread() for part in (self.first, self.then) if hasattr(part, "unread")]
        parts = [counts for counts in parts if counts is not None]
        return [sum(counts) for counts in zip(*parts)] if parts else None

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        self.first.add_row(prompt_ids, encoder_input_ids)
        self.then.add_row(prompt_ids, encoder_input_ids)

    def select(self, rows: list[int]) -> None:
        self.first.select(rows)
        self.then.select(rows)

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        """Row b's free draft if `first` has one, else `then`'s (asked for ks[b] tokens in one
        call for all such rows, 0 for the others)."""
        free = self.first.propose(rows, ks)
        rest = self.then.propose(rows, [0 if len(d.tokens) else k for d, k in zip(free, ks)])
        return [d if len(d.tokens) else r for d, r in zip(free, rest)]

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        self.first.commit(num_accepted, new_tokens)
        self.then.commit(num_accepted, new_tokens)


def find_proposer(proposer, kind: type):
    """The proposer of type `kind` in a composition: `proposer` itself, or a part of a
    FallbackProposer (searched first, then then), or None."""
    if isinstance(proposer, kind):
        return proposer
    if isinstance(proposer, FallbackProposer):
        return find_proposer(proposer.first, kind) or find_proposer(proposer.then, kind)
    return None
