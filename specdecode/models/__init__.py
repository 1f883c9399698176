"""Backends that own a KV cache. One sequence each; rollback means setting a length.

Every backend has:
    vocab_size: int                       width V of the logits it returns
    max_length: int | None                context window, None if unbounded
    length: int                           tokens held in its cache
    forward(tokens [T] int64) -> [T, V]   appends tokens, returns next-token logits at each
    prefill(tokens [T] int64) -> None     appends tokens, returns nothing (no logits computed)
    truncate(length) -> None              drops cache entries past `length` (DESIGN.md §5 rule 5)
    reset() -> None                       empties the cache
"""

from specdecode.models.hf import HFCausalLM
from specdecode.models.table import TableModel

__all__ = ["HFCausalLM", "TableModel"]
