"""A small autoregressive model as the draft (paper §2.1, §3.6), for every running row at once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdecode.proposers.base import Draft, DraftRow, no_draft
from specdecode.sampling import adjust, sample


@dataclass
class _RowState:
    pending: list[int]           # committed tokens the draft's cache has not been fed yet
    drafted: int = 0             # drafts made this step
    fed: int = 0                 # of which the cache holds the first `fed` (never the last)
    base: int = 0                # cache length with the pending tokens in, if they were fed


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

    A row with a logits pipeline (penalties, logits processors, a grammar: DESIGN.md rule 9) drafts
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
    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, backend, confidence_threshold: float = 0.0, tree_width: int = 1,
                 tree_confidence: float = 0.8):
        if not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        if tree_width < 1 or not 0 < tree_confidence <= 1:
            raise ValueError(f"need tree_width >= 1 and tree_confidence in (0, 1], got {tree_width}, {tree_confidence}")
        self.backend = backend
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
        start = time.perf_counter()
        backend, states = self.backend, self.rows
        ks = list(ks)
        if backend.max_length is not None:
            # the cache will hold the committed prefix and k − 1 drafts
            ks = [min(k, backend.max_length - (n + len(s.pending)) + 1)
                  for k, n, s in zip(ks, backend.lengths, states)]
        lengths = backend.lengths
        if len(rows) > 1:
            # A row that drafts for the first time reads its prompt alone (all but the last
            # token, which goes with the batched forward), not padded into every other row's feed.
            for b, (k, n, state) in enumerate(zip(ks, lengths, states)):
                if k > 0 and n == 0 and len(state.pending) > 1:
                    read_start = time.perf_counter()
                    backend.fill(b, [self._feedable(t) for t in state.pending[:-1]])
                    self.read_s += time.perf_counter() - read_start
                    self.read_tokens += len(state.pending) - 1
                    lengths[b], state.pending = len(state.pending) - 1, state.pending[-1:]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        parents: list[list[int]] = [[] for _ in rows]   # tree mode: every node's parent
        chain: list[list[int]] = [[] for _ in rows]     # tree mode: the chain's node indices
        forwards = [0] * len(rows)
        # what each row's next forward must feed: its pending committed tokens, then its drafts so far
        unfed = [list(state.pending) if k > 0 else [] for state, k in zip(states, ks)]
        pending_fed = [False] * len(rows)
        fed = [0] * len(rows)  # drafts in the cache
        pipelines = [getattr(row, "pipeline", None) for row in rows]
        # a row with a logits pipeline drafts a chain: its transforms follow one prefix per position
        tree = [self.tree_width > 1 and pipeline is None for pipeline in pipelines]
        for j in range(max(ks, default=0)):
            live = [b for b in range(len(rows)) if j < ks[b]]
            if not live:  # every row stopped early (dynamic γ)
                break
            need = []
            for b in live:
                forced = self._forced(pipelines[b], rows[b], tokens[b])
                if forced is None:
                    need.append(b)
                    continue
                if forced < 0:  # the grammar took its stop token: nothing can follow
                    ks[b] = j
                    continue
                # the grammar allows one token: it is the draft, with one-hot q, and no forward
                tokens[b].append(forced)
                probs[b].append(torch.nn.functional.one_hot(
                    torch.tensor(forced, device=backend.device), pipelines[b].vocab_size).float())
                unfed[b].append(forced)
            if not need:
                continue
            feeds = [[] for _ in rows]
            for b in need:
                feeds[b] = [self._feedable(t) for t in unfed[b]]
                unfed[b], pending_fed[b] = [], True
                fed[b] = len(chain[b]) if tree[b] else len(tokens[b])
            forward_start = time.perf_counter()
            logits = backend.forward(feeds, 1)[:, 0]  # [B, V]
            if j == 0 and max(len(feed) for feed in feeds) > 2:
                # a row catching up on tokens committed while it did not draft: a read, as a fill
                self.read_s += time.perf_counter() - forward_start
                self.read_tokens += sum(len(feed) for feed in feeds if len(feed) > 2)
            for b in need:
                row = rows[b]
                forwards[b] += 1
                scores = logits[b]
                if pipelines[b] is not None:
                    # the request's penalties, processors and grammar, with prefix committed + drafts so far
                    scores = pipelines[b](row.tokens, tokens[b], scores[None], start=len(tokens[b]))[0]
                    if not torch.isfinite(scores).any():  # nothing allowed within the draft's vocabulary
                        ks[b] = j
                        continue
                q = adjust(scores, row.sampling)
                token = int(q.argmax()) if row.sampling.greedy else int(sample(q, row.generator))
                confidence = None
                if self.confidence_threshold or tree[b]:
                    confidence = float(torch.softmax(logits[b], -1)[token])
                if tree[b]:
                    parents[b].append(chain[b][-1] if chain[b] else -1)
                    chain[b].append(len(tokens[b]))
                tokens[b].append(token)
                probs[b].append(q)
                unfed[b].append(token)
                if tree[b] and confidence < self.tree_confidence:
                    self._branch(row, scores, q, token, tokens[b], probs[b], parents[b])
                if self.confidence_threshold and j + 1 < ks[b] and confidence < self.confidence_threshold:
                    ks[b] = j + 1
        drafts = []
        for b, state in enumerate(states):
            state.drafted = len(chain[b]) if tree[b] else len(tokens[b])
            state.fed = fed[b]
            state.base = lengths[b] + (len(state.pending) if pending_fed[b] else 0)
            if pending_fed[b]:
                state.pending = []
            if not tokens[b]:
                drafts.append(no_draft(backend.vocab_size, backend.device))
                continue
            drafts.append(Draft(torch.tensor(tokens[b], dtype=torch.long, device=backend.device),
                                torch.stack(probs[b]), forwards=forwards[b],
                                parents=tuple(parents[b]) if tree[b] else None))
        self.time_s += time.perf_counter() - start
        return drafts

    def _branch(self, row: DraftRow, logits: torch.Tensor, q: torch.Tensor, token: int, tokens: list[int],
                probs: list[torch.Tensor], parents: list[int]) -> None:
        """Append up to tree_width − 1 siblings of the chain token just drafted (the last node)."""
        parent = parents[-1]
        if row.sampling.greedy:
            # deterministic: the draft's next-best ids, each with a one-hot q
            order = logits.topk(min(self.tree_width, logits.shape[-1])).indices.tolist()
            for sibling in [t for t in order if t != token][:self.tree_width - 1]:
                tokens.append(sibling)
                probs.append(torch.nn.functional.one_hot(torch.tensor(sibling, device=q.device), q.shape[-1]).to(q.dtype))
                parents.append(parent)
            return
        remaining = q.clone()
        for _ in range(self.tree_width - 1):
            # without replacement: drop what was drawn, renormalize; each sibling keeps its own q
            remaining = remaining.clone()  # the previous sibling keeps its own q
            remaining[tokens[-1]] = 0.0
            mass = float(remaining.sum())
            if mass <= 0:
                return
            remaining = remaining / mass
            tokens.append(int(sample(remaining, row.generator)))
            probs.append(remaining)
            parents.append(parent)

    @staticmethod
    def _forced(pipeline, row, drafts: list[int]) -> int | None:
        if pipeline is None or pipeline.grammar is None:
            return None
        return pipeline.forced(row.tokens, drafts)

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
