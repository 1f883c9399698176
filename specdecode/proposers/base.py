"""The proposer protocol: where drafts come from does not matter to the engine (docs/ARCHITECTURE.md, two protocols).

A proposer serves every running row at once. Its rows follow the engine's: `add_row` appends one,
`select` keeps some in order, and `propose` / `commit` take one entry per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdecode.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """One row's proposal for this step."""

    tokens: torch.Tensor   # [k'] int64, 0 <= k' <= k (a proposer may stop early or have nothing)
    probs: torch.Tensor    # [k', V] float32, the q each token was sampled from; one-hot if deterministic
    forwards: int = 0      # draft-model forwards this row took part in
    lookup: bool = False   # copied by prompt lookup
    support: int = 0       # a copied draft's evidence: the length of the match it continues
    # A token tree instead of a chain: parents[i] is node i's parent (-1: the committed prefix),
    # siblings in the order drawn (verify.tree_step). None: tokens form one chain.
    parents: tuple[int, ...] | None = None

    @property
    def chain(self) -> list[int]:
        """The main chain's nodes: from the root, always the first child (all tokens for a chain).
        The draft model's cache holds this chain, and γ counts its length."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        chain, node = [], -1
        for i, parent in enumerate(self.parents):
            if parent == node:
                chain.append(i)
                node = i
        return chain


def no_draft(vocab_size: int, device) -> Draft:
    return Draft(torch.zeros(0, dtype=torch.long, device=device), torch.zeros((0, vocab_size), device=device))


class DraftRow(Protocol):
    """What a proposer may read of a running row."""

    sampling: SamplingParams     # the request's adjustment (docs/exactness.md rule 1)
    generator: torch.Generator   # the request's randomness (rule 7)
    tokens: list[int]            # the committed sequence: prompt + emitted tokens (read-only)
    race_seed: int | None        # sampled rows under verification="drafter-invariant": the target
                                 # samples position t by sampling.race with race_noise(race_seed, t);
                                 # a draft sampling the same way is accepted far more often
    # and `pipeline`: the request's specdecode.processors.LogitsPipeline or None (rule 9). A
    # proposer that samples from model logits should apply it (with prefix committed + its drafts
    # so far) for acceptance; exactness only needs q to be what the draft was sampled from.


class Proposer(Protocol):
    time_s: float  # seconds spent proposing, all rows
    read_s: float  # of time_s, seconds reading committed tokens (a prompt, a row catching up): not a draft step's cost
    read_tokens: int  # the tokens those reads covered
    # Optional: unread() -> list[int], per row the committed tokens the proposer has yet to read
    # before it can draft (the engine's batch cost model charges them; without it reads are free).

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        """A request joins as the last row; its prompt is the committed prefix."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        """Up to ks[b] draft tokens continuing row b's committed prefix, with their q."""

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        """Row b kept its first num_accepted[b] drafts; new_tokens[b] (those drafts and the
        target's next token) now extend its committed prefix."""


def proposer_reads(proposer) -> tuple[float, int]:
    """(read_s, read_tokens) so far: a proposer of a user's may not count them (then 0, 0)."""
    return getattr(proposer, "read_s", 0.0), getattr(proposer, "read_tokens", 0)


class FreeDraftProposer:
    """A proposer of free, deterministic drafts (one-hot q, no model). Subclasses find the
    drafts: `find(b, row, k) -> list[int]` for row b (at most k tokens; [] for none, and then the
    row gets an empty draft: a FallbackProposer hands it to a draft model).

    Which rows get a draft is a function of what the proposer has seen, never of the rows' random
    draws, so every draft stays exact (paper §2.3).

    Args:
        vocab_size: V, the width of the one-hot q.
        device: where the drafts' tensors go (the target's logits' device).
    """

    max_rows = None
    read_s = 0.0  # no model cache: nothing to read
    read_tokens = 0

    def __init__(self, vocab_size: int, device=None):
        self.vocab_size = vocab_size
        self.device = torch.device(device if device is not None else "cpu")
        self.time_s = 0.0

    def find(self, b: int, row: DraftRow, k: int) -> tuple[list[int], int]:
        """(up to k draft ids for row b, the length of the match they continue); ([], 0): none."""
        raise NotImplementedError

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        start = time.perf_counter()
        drafts = []
        for b, (row, k) in enumerate(zip(rows, ks)):
            ids, support = self.find(b, row, k) if k > 0 else ([], 0)
            if ids:
                tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
                drafts.append(Draft(tokens, torch.nn.functional.one_hot(tokens, self.vocab_size).float(), lookup=True,
                                    support=support))
            else:
                drafts.append(no_draft(self.vocab_size, self.device))
        self.time_s += time.perf_counter() - start
        return drafts

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        pass
