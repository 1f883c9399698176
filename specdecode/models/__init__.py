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

Batched backends (HFBatchedCausalLM, BatchedTableModel; used by specdecode.batch) hold B ragged
rows instead:
    vocab_size, max_length                as above; max_length is per row
    lengths: [B] int64                    tokens held per row
    start(batch_size) -> None             B empty rows
    forward(feeds: list[list[int]], num_logits) -> [B, num_logits, V] float32
                                          appends feeds[b] (may be empty) to row b; row b's logits
                                          are the last min(num_logits, len(feeds[b])) entries
    truncate(lengths: list[int]) -> None  row b keeps its first lengths[b] tokens
    select(rows: list[int]) -> None       keeps only these rows, in this order

Seq2SeqLM (encoder–decoder) adds set_input(input_ids): the encoder's input for the request; the
interface above then applies to its decoder tokens.
"""

from specdecode.models.hf import HFCausalLM
from specdecode.models.hf_batch import HFBatchedCausalLM
from specdecode.models.seq2seq import Seq2SeqLM
from specdecode.models.table import BatchedTableModel, TableModel

__all__ = ["HFCausalLM", "HFBatchedCausalLM", "Seq2SeqLM", "TableModel", "BatchedTableModel"]
