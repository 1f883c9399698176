"""Copy from context (paper §3.6; "prompt lookup decoding"): propose what followed the latest
earlier occurrence of the last n tokens. Free to compute (c ≈ 0), deterministic (one-hot q), and
strong wherever the output repeats the prompt or itself (code, edits, extraction)."""

from __future__ import annotations

from specdecode.proposers.base import DraftRow, FreeDraftProposer


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier match of the longest matching suffix of
    `tokens`, that suffix's length n), for n from max_ngram down to min_ngram; ([], 0) when
    nothing matches."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k], n
    return [], 0


class PromptLookupProposer(FreeDraftProposer):
    """Drafts by n-gram lookup in each row's committed sequence; a row without a match gets an
    empty draft (FallbackProposer hands it to a draft model).

    The choice is a function of the row's committed tokens alone, so a row drafts (and draws from
    its generator) exactly as it would alone (rule 7).

    Args:
        vocab_size: width V of the one-hot q it returns.
        max_ngram, min_ngram: the n-gram sizes tried, longest first (1 <= min <= max).
        device: where the drafts' tensors go (default the CPU).
    Raises:
        ValueError: min_ngram or max_ngram out of range.
    """

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 2, device=None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        super().__init__(vocab_size, device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def find(self, b: int, row: DraftRow, k: int) -> tuple[list[int], int]:
        return lookup(row.tokens, k, self.max_ngram, self.min_ngram)
