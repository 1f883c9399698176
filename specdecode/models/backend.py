"""The protocol every engine backend implements (docs/exactness.md rule 5: a row's logits are a
function of its own tokens; rollback sets a length). The engine, the proposers and the tuner call
only these members; tests/test_backend_protocol.py runs one set of checks on every backend.

Backends: models.hf.HFCausalLM (transformers decoder-only models, on torch's kernels or the
batch-invariant ones, a GGUF file's own K-quant blocks included), models.seq2seq.Seq2SeqLM
(encoder–decoder models), models.llamacpp.LlamaCppLM (GGUF files on llama.cpp),
models.table.TableModel (tables, for exact tests).
"""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    """B rows (one per running request), each with its own KV cache length.

    Attributes:
        vocab_size: V, the width of the logits it returns.
        num_embeddings: ids below this can be fed.
        max_length: the context window per row (None: unbounded).
        max_rows: the most rows it holds at once (None: no limit).
        device: where its tensors live (the logits come back there).
        num_rows, lengths: rows held, and tokens held per row.
    """

    vocab_size: int
    num_embeddings: int
    max_length: int | None
    max_rows: int | None
    device: torch.device

    @property
    def num_rows(self) -> int: ...

    @property
    def lengths(self) -> list[int]: ...

    def add_row(self, encoder_input_ids=None, prefix_ids=()) -> None:
        """Append a row holding prefix_ids, read alone (not padded to the batch); an
        encoder–decoder backend takes the request's encoder input here and no prefix."""

    def forward(self, feeds: list[list[int]], num_logits: int) -> torch.Tensor:
        """Append feeds[b] (possibly empty) to row b → [B, num_logits, V] float32: row b's logits
        after its last min(num_logits, len(feeds[b])) tokens, right-aligned."""

    def truncate(self, lengths: list[int]) -> None:
        """Row b keeps its first lengths[b] tokens (rollback)."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def reset(self) -> None:
        """Drop every row."""


@runtime_checkable
class DecoderBackend(Backend, Protocol):
    """A decoder-only backend: rows filled after they join, and prompts scored."""

    def fill(self, row: int, ids) -> None:
        """Give the empty row `row` the tokens ids, read in a forward of its own."""

    def score(self, ids: list[int]) -> Iterator[torch.Tensor]:
        """The next-token logits after each of ids, in chunks [n, V] float32, from a forward of
        their own (prompt logprobs)."""


@runtime_checkable
class TreeBackend(DecoderBackend, Protocol):
    """A decoder backend that verifies token trees: forward(feeds, num_logits, trees) with
    trees[b] the parents of the last len(trees[b]) tokens of feeds[b] (each node attends to its
    ancestors only), then keep_tree_paths before any other call."""

    def forward(self, feeds: list[list[int]], num_logits: int, trees=None) -> torch.Tensor: ...

    def keep_tree_paths(self, paths: list[list[int] | None]) -> None:
        """Per row, the tree nodes (in order) to keep as its tokens; None keeps the row as fed."""
