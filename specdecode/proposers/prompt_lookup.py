"""Copy from context (paper §3.6; "prompt lookup decoding"): propose what followed the latest
earlier occurrence of the last n tokens. Free to compute (c ≈ 0), deterministic (one-hot q), and
strong wherever the output repeats the prompt or itself (code, edits, extraction)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specdecode.proposers.base import Draft, DraftRow, Proposer, no_draft


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix of
    `tokens` (n-grams of max_ngram down to min_ngram tokens); [] when nothing matches."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


class PromptLookupProposer:
    """Drafts by n-gram lookup in each row's committed sequence; rows without a match ask
    `fallback` (in one batched call).

    The choice between lookup and fallback is a function of the row's committed tokens alone, so
    a row drafts (and draws from its generator) exactly as it would alone (rule 7).

    Args:
        vocab_size: width V of the one-hot q it returns.
        max_ngram, min_ngram: the n-gram sizes tried, longest first (1 <= min <= max).
        fallback: a proposer (e.g. DraftModelProposer) for rows without a match, or None to
            propose nothing then (plain decoding for that row and step).
    """

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 2,
                 fallback: Proposer | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.fallback = fallback
        self.max_rows = fallback.max_rows if fallback is not None else None
        self._time_s = 0.0
        self.device = fallback.backend.device if fallback is not None and hasattr(fallback, "backend") \
            else torch.device("cpu")

    @property
    def time_s(self) -> float:
        return self._time_s + (self.fallback.time_s if self.fallback is not None else 0.0)

    @property
    def read_s(self) -> float:
        return self.fallback.read_s if self.fallback is not None else 0.0

    @property
    def read_tokens(self) -> int:
        return self.fallback.read_tokens if self.fallback is not None else 0

    def unread(self) -> list[int] | None:
        return self.fallback.unread() if self.fallback is not None and hasattr(self.fallback, "unread") else None

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        if self.fallback is not None:
            self.fallback.add_row(prompt_ids, encoder_input_ids)

    def select(self, rows: list[int]) -> None:
        if self.fallback is not None:
            self.fallback.select(rows)

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        start = time.perf_counter()
        found = [lookup(row.tokens, k, self.max_ngram, self.min_ngram) if k > 0 else [] for row, k in zip(rows, ks)]
        drafts: list[Draft | None] = [None] * len(rows)
        for b, ids in enumerate(found):
            if ids:
                tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
                drafts[b] = Draft(tokens, torch.nn.functional.one_hot(tokens, self.vocab_size).float(), lookup=True)
        self._time_s += time.perf_counter() - start
        if self.fallback is not None:
            rest = self.fallback.propose(rows, [0 if ids else k for ids, k in zip(found, ks)])
        else:
            rest = [no_draft(self.vocab_size, self.device)] * len(rows)
        return [d if d is not None else r for d, r in zip(drafts, rest)]

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        if self.fallback is not None:
            self.fallback.commit(num_accepted, new_tokens)
