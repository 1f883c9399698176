"""Backends that own a KV cache for B rows (one per running request); rollback sets a length.

Every backend has (docs/ARCHITECTURE.md; docs/exactness.md rule 5):
    vocab_size: int                       width V of the logits it returns
    num_embeddings: int                   ids below this can be fed
    max_length: int | None                context window per row, None if unbounded
    max_rows: int | None                  the most rows it can hold (None: no limit)
    device: torch.device                  where its tensors live
    num_rows: int;  lengths: list[int]    rows held, and tokens held per row
    add_row(encoder_input_ids=None, prefix_ids=())
                                          appends a row holding prefix_ids, read alone (not
                                          padded to the batch); an encoder–decoder backend takes
                                          the request's encoder input here and no prefix
    fill(row, ids)                        gives an empty row ids, read alone (backends with
                                          max_rows != 1)
    forward(feeds: list[list[int]], num_logits) -> [B, num_logits, V] float32
                                          appends feeds[b] (may be empty) to row b; row b's
                                          logits are its last min(num_logits, len(feeds[b]))
                                          entries, right-aligned
    truncate(lengths: list[int])          row b keeps its first lengths[b] tokens
    select(rows: list[int])               keeps only these rows, in this order
    reset()                               drops every row
"""

import importlib

_NAMES = {"HFCausalLM": "specdecode.models.hf", "Seq2SeqLM": "specdecode.models.seq2seq",
          "TableModel": "specdecode.models.table"}
__all__ = ["HFCausalLM", "Seq2SeqLM", "TableModel"]


def __getattr__(name: str):  # loaded on first use: the CLI reads zoo names without importing torch
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdecode.models' has no attribute {name!r}")
