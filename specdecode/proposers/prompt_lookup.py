"""Copy from context (paper §3.6; "prompt lookup decoding"): propose what followed the latest
earlier occurrence of the last n tokens. Free to compute (c ≈ 0), deterministic (one-hot q), and
strong wherever the output repeats the prompt or itself (code, edits, extraction)."""

from __future__ import annotations

import time

import torch

from specdecode.proposers.base import Draft, Proposer
from specdecode.sampling import SamplingParams


class PromptLookupProposer:
    """Drafts by n-gram lookup in the committed sequence; when nothing matches, asks `fallback`.

    Args:
        vocab_size: width V of the one-hot q it returns.
        max_ngram, min_ngram: the n-gram sizes tried, longest first (1 <= min <= max).
        fallback: a proposer (e.g. DraftModelProposer) for steps without a match, or None to
            propose nothing then (plain decoding for that step).
    """

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 2,
                 fallback: Proposer | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.fallback = fallback
        self.num_lookups = 0
        self._time_s = 0.0

    @property
    def num_calls(self) -> int:
        return self.fallback.num_calls if self.fallback is not None else 0

    @property
    def time_s(self) -> float:
        return self._time_s + (self.fallback.time_s if self.fallback is not None else 0.0)

    def configure(self, sampling: SamplingParams, generator: torch.Generator) -> None:
        if self.fallback is not None:
            self.fallback.configure(sampling, generator)

    def start(self, prompt: torch.Tensor) -> None:
        self.tokens = prompt.tolist()
        self.num_lookups = 0
        self._time_s = 0.0
        if self.fallback is not None:
            self.fallback.start(prompt)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest matching suffix."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == pattern:
                    return tokens[start + n:start + n + k]
        return []

    def propose(self, k: int) -> Draft:
        start = time.perf_counter()
        found = self.lookup(k)
        self._time_s += time.perf_counter() - start
        if found:
            self.num_lookups += 1
            ids = torch.tensor(found, dtype=torch.long)
            return Draft(ids, torch.nn.functional.one_hot(ids, self.vocab_size).float())
        if self.fallback is not None:
            return self.fallback.propose(k)
        return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, self.vocab_size))

    def commit(self, num_accepted: int, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.fallback is not None:
            self.fallback.commit(num_accepted, tokens)
