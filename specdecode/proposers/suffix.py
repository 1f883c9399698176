"""Suffix drafts (SuffixDecoding: Oliaro et al., NeurIPS 2025): find the longest match of a row's
latest tokens in its own prompt and output and in earlier requests' sequences, and propose the
continuation that most often followed it, token by token, while its empirical probability holds.

Free to compute (c ≈ 0) and deterministic (one-hot q), so exact as every deterministic draft is
(paper §2.3: the rejection rule gives the target's distribution for any q). It extends prompt
lookup (paper §3.6) in three ways: matches up to `max_match` tokens rather than 3, the most
frequent continuation rather than the latest, and a draft length set by that frequency (a
well-supported continuation runs long, a contested one stops early) rather than always γ.

Earlier requests: the proposer lives as long as its engine (the server's, the batch job's), and
each finished row's tokens join a bounded, least-recently-used cache of sequences. A seeded
sampled request drafts from its own tokens only, so its output does not depend on what else the
engine has decoded (the drafts decide which random numbers are drawn; docs/exactness.md rule 7); greedy
and unseeded requests use the cache too.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Sequence

from specdecode.proposers.base import DraftRow, FreeDraftProposer


class SuffixIndex:
    """Where the n-grams of some token sequences end, for n in `levels` (e.g. 2, 4 and 8 tokens):
    for each n-gram, the latest `max_occurrences` (sequence id, end position) pairs. A lookup
    tries the longest level first, so a long match is found even where its short suffix is common.

    Sequences are appended to (a row's output grows) and removed (least recently used); a removed
    sequence's entries are skipped when read and dropped when the index rebuilds.
    """

    def __init__(self, levels: tuple[int, ...] = (2, 4, 8), max_occurrences: int = 64):
        if not levels or min(levels) < 1:
            raise ValueError(f"levels must be n-gram sizes >= 1, got {levels}")
        self.levels, self.max_occurrences = tuple(sorted(set(levels))), max_occurrences
        self.sequences: dict[int, list[int]] = {}
        self._ends: dict[tuple[int, ...], deque] = {}
        self._live = self._dead = 0           # tokens of live sequences; of removed ones still indexed

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence seq_id (a new one if unknown) and index the n-grams ending in them."""
        seq = self.sequences.setdefault(seq_id, [])
        start = len(seq)
        seq.extend(tokens)
        self._live += len(tokens)
        for end in range(start + 1, len(seq) + 1):
            for n in self.levels:
                if n > end:
                    break
                key = tuple(seq[end - n:end])
                ends = self._ends.get(key)
                if ends is None:
                    ends = self._ends[key] = deque(maxlen=self.max_occurrences)
                ends.append((seq_id, end))

    def remove(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return
        self._live -= len(seq)
        self._dead += len(seq)
        if self._dead > self._live:  # mostly stale: rebuild
            live = list(self.sequences.items())
            self.sequences, self._ends, self._live, self._dead = {}, {}, 0, 0
            for other_id, other in live:
                self.append(other_id, other)

    def continuations(self, key: tuple[int, ...]) -> list[tuple[int, list[int], int]]:
        """(sequence id, sequence, position after the match) of the key's live occurrences that
        have a next token (so a row's latest tokens, the match being continued, are not among them)."""
        found = []
        for seq_id, end in self._ends.get(key, ()):
            seq = self.sequences.get(seq_id)
            if seq is not None and end < len(seq):
                found.append((seq_id, seq, end))
        return found


def continue_by_frequency(occurrences: list[tuple[list[int], int]], k: int, min_prob: float) -> list[int]:
    """Walk (sequence, position) occurrences forward: at each step the most frequent next token
    among those still agreeing with the draft so far, while the product of those frequencies
    stays >= min_prob; at most k tokens. Ties go to the latest occurrence's token."""
    draft, prob = [], 1.0
    while len(draft) < k and occurrences:
        counts = Counter(seq[end] for seq, end in reversed(occurrences))  # insertion order: latest first
        token, count = counts.most_common(1)[0]
        prob *= count / len(occurrences)
        if prob < min_prob:
            break
        draft.append(token)
        occurrences = [(seq, end + 1) for seq, end in occurrences if seq[end] == token and end + 1 < len(seq)]
    return draft


class SuffixProposer(FreeDraftProposer):
    """Drafts from suffix matches in each row's own tokens and in earlier requests' sequences; a
    row without a match gets an empty draft (FallbackProposer hands it to a draft model).

    Args:
        vocab_size: width V of the one-hot q it returns.
        levels: the match lengths tried, longest first (SuffixIndex).
        min_prob: a draft stops where its empirical probability (the product of each step's
            frequency among the matches) falls below this.
        max_spec_factor: a match of n tokens drafts at most max_spec_factor·n tokens (short
            matches are weak evidence).
        cache_tokens: tokens of earlier requests kept (least recently used dropped); 0: none.
        share_seeded: seeded sampled requests draft from earlier requests too (still exact in
            distribution, but a seed's output then depends on what the engine decoded before).
        device: where the drafts' tensors go (default the CPU).
    """

    def __init__(self, vocab_size: int, levels: tuple[int, ...] = (2, 4, 8), min_prob: float = 0.1,
                 max_spec_factor: float = 2.0, cache_tokens: int = 100_000, share_seeded: bool = False,
                 device=None):
        super().__init__(vocab_size, device)
        self.min_prob, self.max_spec_factor = min_prob, max_spec_factor
        self.levels = tuple(sorted(set(levels), reverse=True))
        self.cache_tokens, self.share_seeded = cache_tokens, share_seeded
        self.cache = SuffixIndex(levels)                          # earlier requests' sequences
        self._cached: OrderedDict[int, int] = OrderedDict()       # their ids, least recently used first
        self._next_id = 0
        self._rows: list[tuple[int, SuffixIndex]] = []            # per running row: (id, its own index)

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        own = SuffixIndex(self.levels)
        own.append(0, list(prompt_ids))
        self._rows.append((self._new_id(), own))

    def select(self, rows: list[int]) -> None:
        kept = set(rows)
        for b, (row_id, own) in enumerate(self._rows):
            if b not in kept:  # finished or aborted: its tokens serve later requests
                self._remember(row_id, own.sequences[0])
        self._rows = [self._rows[b] for b in rows]

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for (_, own), new in zip(self._rows, new_tokens):
            own.append(0, new)

    def find(self, b: int, row: DraftRow, k: int) -> tuple[list[int], int]:
        """(the most frequent continuation of the longest level n that matches the row's last
        tokens, n)."""
        tokens, own = row.tokens, self._rows[b][1]
        # seeded sampling: its own tokens only (unless share_seeded)
        shared = row.sampling.greedy or row.sampling.seed is None or self.share_seeded
        for n in self.levels:
            if n > len(tokens):
                continue
            key = tuple(tokens[-n:])
            found = own.continuations(key)
            if shared:
                cached = self.cache.continuations(key)
                for seq_id in {seq_id for seq_id, _, _ in cached}:
                    self._cached.move_to_end(seq_id)  # used: kept longer
                found = cached + found  # ties go to the latest: the row's own
            if found:
                return continue_by_frequency([(seq, end) for _, seq, end in found],
                                             min(k, int(self.max_spec_factor * n)), self.min_prob), n
        return [], 0

    def forget(self) -> None:
        """Drop every earlier request's sequences (running rows keep their own)."""
        self.cache = SuffixIndex(self.levels)
        self._cached.clear()

    # --- internals -------------------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _remember(self, row_id: int, tokens: list[int]) -> None:
        if self.cache_tokens <= 0 or not tokens:
            return
        self.cache.append(row_id, tokens)
        self._cached[row_id] = len(tokens)
        total = sum(self._cached.values())
        while total > self.cache_tokens and self._cached:
            old_id, size = self._cached.popitem(last=False)
            self.cache.remove(old_id)
            total -= size
