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

Seq2SeqLM (encoder–decoder) adds set_input(input_ids): the encoder's input for the request; the
interface above then applies to its decoder tokens.
"""

from specdecode.models.hf import HFCausalLM
from specdecode.models.seq2seq import Seq2SeqLM
from specdecode.models.table import TableModel

__all__ = ["HFCausalLM", "Seq2SeqLM", "TableModel"]
