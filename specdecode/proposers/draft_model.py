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
    drafted: int = 0             # drafts made this step (the last one is never fed)
    base: int = 0                # cache length once the pending tokens are in


class DraftModelProposer:
    """Samples up to k tokens per row, one draft forward per drafted position for all rows.

    Each row's cache holds its committed prefix minus the `pending` tokens it has not been fed yet
    (at first the whole prompt; later the target's last token and, after a fully accepted block,
    the last draft); they go in with the row's first forward of the next proposal, so prefill and
    rollback cost no extra call. In a batch, a row's first proposal reads its prompt alone
    (`fill`) instead: padding every other row's feed to a prompt's length would cost B times more. A row that drafts less than the others (or nothing: prompt
    lookup had a proposal, the guard paused it) feeds nothing at the later positions, and its
    committed tokens queue up as pending.

    Drafting of a row stops early when the draft's own probability of the token it just chose
    falls below `confidence_threshold` (dynamic γ). The rule looks only at the draft's side, so
    the output distribution is unchanged: each drafted position is still verified exactly.

    Args:
        backend: a model backend (specdecode.models) for the draft model.
        confidence_threshold: in [0, 1); 0 always drafts k tokens. The confidence is the draft's
            untempered softmax probability of the chosen token (also under greedy decoding).
    """

    def __init__(self, backend, confidence_threshold: float = 0.0):
        if not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.backend = backend
        self.confidence_threshold = confidence_threshold
        self.max_rows = backend.max_rows
        self.rows: list[_RowState] = []
        self.time_s = 0.0
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
                    backend.fill(b, [self._feedable(t) for t in state.pending[:-1]])
                    lengths[b], state.pending = len(state.pending) - 1, state.pending[-1:]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        forwards = [0] * len(rows)
        for b, state in enumerate(states):
            state.drafted = 0
            state.base = lengths[b] + (len(state.pending) if ks[b] > 0 else 0)
        for j in range(max(ks, default=0)):
            live = [b for b in range(len(rows)) if j < ks[b]]
            if not live:  # every row stopped early (dynamic γ)
                break
            feeds = [[] for _ in rows]
            for b in live:
                feeds[b] = [self._feedable(t) for t in (states[b].pending if j == 0 else tokens[b][-1:])]
            logits = backend.forward(feeds, 1)[:, 0]  # [B, V]
            for b in live:
                row = rows[b]
                forwards[b] += 1
                q = adjust(logits[b], row.sampling)
                token = int(q.argmax()) if row.sampling.greedy else int(sample(q, row.generator))
                tokens[b].append(token)
                probs[b].append(q)
                if self.confidence_threshold and j + 1 < ks[b] and \
                        float(torch.softmax(logits[b], -1)[token]) < self.confidence_threshold:
                    ks[b] = j + 1
        drafts = []
        for b, state in enumerate(states):
            state.drafted = len(tokens[b])
            if not tokens[b]:
                drafts.append(no_draft(backend.vocab_size, backend.device))
                continue
            state.pending = []
            drafts.append(Draft(torch.tensor(tokens[b], dtype=torch.long, device=backend.device),
                                torch.stack(probs[b]), forwards=forwards[b]))
        self.time_s += time.perf_counter() - start
        return drafts

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for state, n, new in zip(self.rows, num_accepted, new_tokens):
            if state.drafted:
                # The cache holds the prefix plus drafts[:-1]; the last draft was never fed.
                kept = min(n, state.drafted - 1)
                state.pending = list(new[kept:])
                state.base += kept
            else:  # the draft sat this step out: its cache did not move, the tokens queue up
                state.pending += new
            state.drafted = 0
        self.backend.truncate([state.base for state in self.rows])
