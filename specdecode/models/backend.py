"""The protocol every engine backend implements (docs/exactness.md rule 5: a row's logits are a
function of its own tokens; rollback sets a length). The engine, the proposers and the tuner call
only these members; tests/test_backend_protocol.py runs one set of checks on every backend.

Backends: models.hf.HFCausalLM (transformers decoder-only models, on torch's kernels or the
batch-invariant ones, a GGUF file's own K-quant blocks included), models.seq2seq.Seq2SeqLM
(encoder–decoder models), models.llamacpp.LlamaCppLM (GGUF files on llama.cpp),
models.table.TableModel (tables, for exact tests). The argument checks they share (a row to fill,
feeds, rollback lengths, token trees and the paths kept of them) are the functions below, so every
backend refuses the same calls with the same messages.
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


# --- the argument checks every backend makes -------------------------------------------------------


def check_empty_row(row: int, held: int) -> None:
    """Raises ValueError where row `row`, to be filled, already holds `held` tokens."""
    if held != 0:
        raise ValueError(f"row {row} holds {held} tokens; only an empty row can be filled")


def check_feeds(feeds, num_rows: int, num_logits: int | None = None) -> None:
    """Raises ValueError unless feeds has one token list per row (num_rows) and not every one is
    empty; num_logits, where given (a backend that fills exactly that many positions per row), must
    be >= 1 too."""
    lengths = [len(f) for f in feeds]
    if num_logits is None:
        if len(lengths) != num_rows or not any(lengths):
            raise ValueError(f"need {num_rows} feeds, not all empty; got lengths {lengths}")
    elif len(lengths) != num_rows or not any(lengths) or num_logits < 1:
        raise ValueError(f"need {num_rows} feeds, not all empty, and num_logits >= 1; got lengths {lengths}, "
                         f"num_logits {num_logits}")


def check_truncate(lengths, held: list[int]) -> list[int]:
    """lengths as ints, one per row, each within 0 .. the tokens its row holds (held[b]).

    Raises:
        ValueError: another number of lengths than rows, or a length out of that range.
    """
    lengths = [int(n) for n in lengths]
    if len(lengths) != len(held) or any(not 0 <= n <= h for n, h in zip(lengths, held)):
        raise ValueError(f"cannot truncate rows holding {list(held)} tokens to {lengths}")
    return lengths


def check_tree(row: int, parents: list[int], feed_length: int) -> None:
    """Raises ValueError unless every parent is -1 (the token before the tree) or an earlier node,
    and the tree's len(parents) nodes fit in row `row`'s feed of feed_length tokens."""
    if any(not -1 <= parent < i for i, parent in enumerate(parents)):
        raise ValueError(f"row {row}: every parent must be -1 or an earlier node, got {list(parents)}")
    if len(parents) > feed_length:
        raise ValueError(f"row {row}: a tree of {len(parents)} nodes in a feed of {feed_length} tokens")


def check_tree_paths(paths: list[list[int] | None], trees: list[list[int] | None] | None) -> None:
    """Raises ValueError unless paths (keep_tree_paths') follow a tree forward (trees: per row, the
    parents of its tree or None; None: no tree forward just before) with one entry per row, and
    each row with a tree keeps a root-to-node path of it (possibly empty)."""
    if trees is None or len(paths) != len(trees):
        raise ValueError("keep_tree_paths needs the tree forward just before it, one entry per row")
    for b, (parents, path) in enumerate(zip(trees, paths)):
        if parents is None:
            continue
        if path is None or any(not 0 <= node < len(parents) or parents[node] != (path[j - 1] if j else -1)
                               for j, node in enumerate(path)):
            raise ValueError(f"row {b}: {path} is not a path from the root of its tree (parents {parents})")
