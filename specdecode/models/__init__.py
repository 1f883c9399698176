"""Backends that own a KV cache. One sequence each; rollback means setting a length.

Every backend has:
    vocab_size: int                       width V of the logits it returns
    max_length: int | None                context window, None if unbounded
    length: int                           tokens held in its cache
    forward(tokens [T] int64, num_logits) -> [num_logits, V]
                                          appends tokens, returns the next-token logits after
                                          each of the last num_logits of them
    truncate(length) -> None              drops cache entries past `length` (DESIGN.md §5 rule 5)
    reset() -> None                       empties the cache
"""

from specdecode.models.hf import HFCausalLM
from specdecode.models.hf_batch import HFBatchedCausalLM
from specdecode.models.table import BatchedTableModel, TableModel

__all__ = ["HFCausalLM", "HFBatchedCausalLM", "TableModel", "BatchedTableModel"]
