"""A small autoregressive model as the draft (paper §2.1, §3.6), for every running row at once."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdecode.proposers import tree
from specdecode.proposers.base import Draft, DraftRow, no_draft
from specdecode.sampling import adjust, first_argmax, race, race_noise, sample


@dataclass
class _RowState:
    pending: list[int]           # committed tokens the draft's cache has not been fed yet
    drafted: int = 0             # drafts made this step
    fed: int = 0                 # of which the cache holds the first `fed` (never the last)
    base: int = 0                # cache length with the pending tokens in, if they were fed


class _Proposal:
    """One row's proposal in the making (one propose() call): its drafts so far with their q, a
    tree's parents and chain, what its cache has not been fed, and the plan k (lowered where
    drafting stops early)."""

    def __init__(self, b: int, row: DraftRow, k: int, state: _RowState, pipeline, tree_width: int):
        self.b, self.row, self.k, self.state, self.pipeline = b, row, k, state, pipeline
        # a row with a logits pipeline drafts a chain: its transforms follow one prefix per position
        self.tree = tree_width > 1 and pipeline is None
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.parents: list[int] = []   # tree: every node's parent
        self.chain: list[int] = []     # tree: the chain's node indices
        self.forwards = 0
        # what the row's next forward must feed: its pending committed tokens, then its drafts so far
        self.unfed: list[int] = list(state.pending) if k > 0 else []
        self.pending_fed = False
        self.fed = 0                   # drafts in the cache


class DraftModelProposer:
    """Samples up to k tokens per row, one draft forward per drafted position for all rows.

    Each row's cache holds its committed prefix minus the `pending` tokens it has not been fed yet
    (at first the whole prompt; later the target's last token and, after a fully accepted block,
    the last draft); they go in with the row's first forward of the next proposal, so prefill and
    rollback cost no extra call. In a batch, a row's first proposal reads its prompt alone
    (`fill`) instead: padding every other row's feed to a prompt's length would cost B times
    more. A row that drafts less than the others (or nothing: prompt lookup had a proposal, the
    guard paused it) feeds nothing at the later positions, and its committed tokens queue up as
    pending.

    A row with a logits pipeline (penalties, logits processors, a grammar: docs/exactness.md rule 9) drafts
    from its transformed logits, padded or cut to the target's vocabulary, with prefix committed +
    drafts so far; where its grammar allows only one token, that token is the draft (one-hot q)
    and costs no forward.

    Drafting of a row stops early when the draft's own probability of the token it just chose
    falls below `confidence_threshold` (dynamic γ). The rule looks only at the draft's side, so
    the output distribution is unchanged: each drafted position is still verified exactly.

    With tree_width > 1 it proposes a token tree (SpecInfer/Sequoia style, verify.tree_step): the
    chain as above, and at each position where the draft is less than `tree_confidence` sure of
    its chain token, up to tree_width − 1 sibling leaves: for a sampled row drawn from q without
    replacement (each with the renormalized q it was drawn from), for a greedy row the draft's
    next-best tokens (one-hot q). Leaves cost no draft forward; the target scores them in the
    same call. Both the shape and the leaves depend on the draft's side only, so it stays exact.
    A row with a logits pipeline drafts a chain (its transforms follow one prefix per position).

    Args:
        backend: a model backend (specdecode.models) for the draft model.
        confidence_threshold: in [0, 1); 0 always drafts k tokens. The confidence is the draft's
            untempered softmax probability of the chosen token (also under greedy decoding).
        tree_width: candidates per uncertain position (>= 1; 1 drafts a chain).
        tree_confidence: in (0, 1]; branch where the chain token's confidence is below it.
        clock: seconds, monotonic (time.perf_counter), for time_s and read_s; the engine's, so
            that the two agree (tests pass one they move by hand).
    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, backend, confidence_threshold: float = 0.0, tree_width: int = 1,
                 tree_confidence: float = 0.8, clock: Callable[[], float] = time.perf_counter):
        if not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        if tree_width < 1 or not 0 < tree_confidence <= 1:
            raise ValueError(f"need tree_width >= 1 and tree_confidence in (0, 1], got {tree_width}, {tree_confidence}")
        self.backend, self.clock = backend, clock
        self.confidence_threshold = confidence_threshold
        self.tree_width, self.tree_confidence = tree_width, tree_confidence
        self.max_rows = backend.max_rows
        self.rows: list[_RowState] = []
        self.time_s = self.read_s = 0.0
        self.read_tokens = 0  # tokens those reads covered
        backend.reset()

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        self.backend.add_row(encoder_input_ids)
        self.rows.append(_RowState(pending=list(prompt_ids)))

    def select(self, rows: list[int]) -> None:
        self.backend.select(rows)
        self.rows = [self.rows[b] for b in rows]

    def _feedable(self, token: int) -> int:
        # An id the draft cannot embed (a target vocabulary padded past the draft's table) is fed
        # as 0: only the proposals after it suffer, and they are verified exactly anyway.
        return token if token < self.backend.num_embeddings else 0

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        start = self.clock()
        backend = self.backend
        ks = list(ks)
        if backend.max_length is not None:
            # the cache will hold the committed prefix and k − 1 drafts
            ks = [min(k, backend.max_length - (n + len(s.pending)) + 1)
                  for k, n, s in zip(ks, backend.lengths, self.rows)]
        lengths = backend.lengths
        if len(rows) > 1:
            self._read_prompts(ks, lengths)
        plans = [_Proposal(b, row, k, self.rows[b], getattr(row, "pipeline", None), self.tree_width)
                 for b, (row, k) in enumerate(zip(rows, ks))]
        for j in range(max(ks, default=0)):
            live = [p for p in plans if j < p.k]
            if not live:  # every row stopped early (dynamic γ)
                break
            need = [p for p in live if not self._take_forced(p, j)]
            if not need:
                continue
            logits = self._forward(plans, need, j)
            for p in need:
                self._draft_next(p, logits[p.b], j)
        drafts = [self._settle(p, lengths[p.b]) for p in plans]
        self.time_s += self.clock() - start
        return drafts

    def _read_prompts(self, ks: list[int], lengths: list[int]) -> None:
        """In a batch, a row that drafts for the first time reads its prompt alone (all but the last
        token, which goes with the batched forward), not padded into every other row's feed."""
        for b, (k, n, state) in enumerate(zip(ks, lengths, self.rows)):
            if k > 0 and n == 0 and len(state.pending) > 1:
                read_start = self.clock()
                self.backend.fill(b, [self._feedable(t) for t in state.pending[:-1]])
                self.read_s += self.clock() - read_start
                self.read_tokens += len(state.pending) - 1
                lengths[b], state.pending = len(state.pending) - 1, state.pending[-1:]

    def _take_forced(self, p: _Proposal, j: int) -> bool:
        """Where the row's grammar allows one token, it is the draft (one-hot q, no forward); where
        it took its stop token, the row's drafting ends. Returns whether the row needs no forward."""
        if p.pipeline is None or p.pipeline.grammar is None:
            return False
        forced = p.pipeline.forced(p.row.tokens, p.tokens)
        if forced is None:
            return False
        if forced < 0:  # the grammar took its stop token: nothing can follow
            p.k = j
            return True
        p.tokens.append(forced)
        p.probs.append(torch.nn.functional.one_hot(torch.tensor(forced, device=self.backend.device),
                                                   p.pipeline.vocab_size).float())
        p.unfed.append(forced)
        return True

    def _forward(self, plans: list[_Proposal], need: list[_Proposal], j: int) -> torch.Tensor:
        """One draft forward for the rows that need one, each fed what its cache lacks (pending
        committed tokens, then its drafts so far) → their next-token logits [B, V]."""
        feeds = [[] for _ in plans]
        for p in need:
            feeds[p.b] = [self._feedable(t) for t in p.unfed]
            p.unfed, p.pending_fed = [], True
            p.fed = len(p.chain) if p.tree else len(p.tokens)
        forward_start = self.clock()
        logits = self.backend.forward(feeds, 1)[:, 0]
        if j == 0 and max(len(feed) for feed in feeds) > 2:
            # a row catching up on tokens committed while it did not draft: a read, as a fill
            self.read_s += self.clock() - forward_start
            self.read_tokens += sum(len(feed) for feed in feeds if len(feed) > 2)
        return logits

    def _draft_next(self, p: _Proposal, logits: torch.Tensor, j: int) -> None:
        """Sample the row's next draft token from its adjusted logits (its own generator), branch
        a tree where the draft is unsure, and stop drafting where it is less sure than the threshold."""
        row = p.row
        p.forwards += 1
        scores = logits
        if p.pipeline is not None:
            # the request's penalties, processors and grammar, with prefix committed + drafts so far
            scores = p.pipeline(row.tokens, p.tokens, scores[None], start=len(p.tokens))[0]
            if not torch.isfinite(scores).any():  # nothing allowed within the draft's vocabulary
                p.k = j
                return
        q = adjust(scores, row.sampling)
        if row.sampling.greedy:
            token = int(first_argmax(q))
        elif row.race_seed is not None:  # the target's noise at this position: the two races agree often
            token = int(race(q, race_noise(row.race_seed, len(row.tokens) + len(p.tokens), q.shape[-1]).to(q.device)))
        else:
            token = int(sample(q, row.generator))
        confidence = None
        if self.confidence_threshold or p.tree:
            confidence = float(torch.softmax(logits, -1)[token])
        if p.tree:
            p.parents.append(p.chain[-1] if p.chain else -1)
            p.chain.append(len(p.tokens))
        p.tokens.append(token)
        p.probs.append(q)
        p.unfed.append(token)
        if p.tree and confidence < self.tree_confidence:
            parent = p.parents[-1]  # the chain token's: its siblings share it
            for sibling, sibling_q in tree.siblings(scores, q, token, self.tree_width, row.sampling, row.generator):
                p.tokens.append(sibling)
                p.probs.append(sibling_q)
                p.parents.append(parent)
        if self.confidence_threshold and j + 1 < p.k and confidence < self.confidence_threshold:
            p.k = j + 1

    def _settle(self, p: _Proposal, length: int) -> Draft:
        """The row's Draft; its cache state noted for commit()."""
        state = p.state
        state.drafted = len(p.chain) if p.tree else len(p.tokens)
        state.fed = p.fed
        state.base = length + (len(state.pending) if p.pending_fed else 0)
        if p.pending_fed:
            state.pending = []
        if not p.tokens:
            return no_draft(self.backend.vocab_size, self.backend.device)
        return Draft(torch.tensor(p.tokens, dtype=torch.long, device=self.backend.device), torch.stack(p.probs),
                     forwards=p.forwards, parents=tuple(p.parents) if p.tree else None)

    def unread(self) -> list[int]:
        """Per row, the committed tokens its cache has not read (a row that never drafted: all)."""
        return [len(state.pending) for state in self.rows]

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for state, n, new in zip(self.rows, num_accepted, new_tokens):
            # The cache holds the prefix up to `base` plus the first `fed` drafts (never the last
            # draft, nor forced ones after the last forward); what it lacks queues up as pending.
            # A row that sat the step out fed nothing: fed = 0 and its base did not move.
            kept = min(n, state.fed)
            state.pending = state.pending + list(new[kept:])
            state.base += kept
            state.drafted = state.fed = 0
        self.backend.truncate([state.base for state in self.rows])
