"""A model defined by a table: next-token logits are a pure function of the last `order` tokens.

For tests: exact distributions are known, so sequence probabilities can be enumerated. It has the
engine's backend interface (rows that join and leave, per-row rollback), and its logits are
exactly the table's whatever the batch, so batched and single runs compare token for token.
"""

from __future__ import annotations

import torch

from specdecode.models.backend import check_empty_row, check_feeds, check_tree, check_tree_paths, check_truncate


class TableModel:
    """Logits from a seeded random table indexed by the last `order` tokens.

    Args:
        vocab_size: V.  order: context tokens the logits depend on (>= 1).
        seed: builds the table; two models with different seeds disagree.
        sharpness: scale of the random logits (larger → peakier distributions).
        max_length: context window, None for unbounded.
    Attributes:
        num_forward_calls: forwards so far (for tests that count calls).
    """

    max_rows = None
    device = torch.device("cpu")

    def __init__(self, vocab_size: int, order: int = 2, seed: int = 0, sharpness: float = 2.0,
                 max_length: int | None = None):
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = self.num_embeddings = vocab_size
        self.order = order
        self.max_length = max_length
        self.table = sharpness * torch.randn((vocab_size,) * order + (vocab_size,), generator=generator)
        self.rows: list[list[int]] = []
        self.num_forward_calls = 0

    def logits_for(self, prefix: list[int] | tuple[int, ...]) -> torch.Tensor:
        """[V] float32 logits after `prefix` (left-padded with token 0 when shorter than order)."""
        context = ([0] * self.order + list(prefix))[-self.order:]
        return self.table[tuple(context)]

    def score(self, ids: list[int]):
        """The logits after each prefix of ids (prompt logprobs): one [len(ids), V] chunk."""
        yield torch.stack([self.logits_for(ids[:j + 1]) for j in range(len(ids))])

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.rows]

    def reset(self) -> None:
        self.rows = []

    def add_row(self, encoder_input_ids=None, prefix_ids=()) -> None:
        if encoder_input_ids is not None:
            raise ValueError("a table model takes no encoder input")
        self.rows.append([])
        self.fill(len(self.rows) - 1, prefix_ids)

    def fill(self, row: int, ids) -> None:
        """Give the empty row `row` the tokens ids."""
        check_empty_row(row, len(self.rows[row]))
        self.rows[row] = [int(t) for t in ids]

    def forward(self, feeds: list[list[int]], num_logits: int,
                trees: list[list[int] | None] | None = None) -> torch.Tensor:
        """Append feeds[b] to row b; [B, num_logits, V]: row b's logits right-aligned, 0 elsewhere.
        trees: as HFCausalLM.forward (a tree node's logits are those after its own path)."""
        check_feeds(feeds, len(self.rows))
        trees = trees or [None] * len(feeds)
        self.num_forward_calls += 1
        self._trees = [None] * len(feeds)
        out = torch.zeros((len(feeds), num_logits, self.vocab_size))
        for b, (feed, parents) in enumerate(zip(feeds, trees)):
            row = self.rows[b]
            n = len(parents) if parents is not None else 0
            if parents is not None:
                check_tree(b, parents, len(feed))
            row.extend(int(t) for t in feed[:len(feed) - n])
            # the prefix each fed token's logits follow: the row so far, or for a tree node its path
            contexts = [row[:len(row) - (len(feed) - n) + j + 1] for j in range(len(feed) - n)]
            before = list(row)
            tree_tokens = [int(t) for t in feed[len(feed) - n:]]
            for i in range(n):
                path, node = [], i
                while node != -1:
                    path.append(tree_tokens[node])
                    node = parents[node]
                contexts.append(before + path[::-1])
            if parents is not None:
                self._trees[b] = (len(row), list(parents), tree_tokens)
                row.extend(tree_tokens)
            m = min(num_logits, len(feed))
            for j in range(m):
                out[b, num_logits - m + j] = self.logits_for(contexts[len(feed) - m + j])
        return out

    def keep_tree_paths(self, paths: list[list[int] | None]) -> None:
        """After a tree forward, row b keeps only the nodes of paths[b] of its tree (as HFCausalLM)."""
        trees = getattr(self, "_trees", None)
        check_tree_paths(paths, None if trees is None else [None if t is None else t[1] for t in trees])
        for b, (tree, path) in enumerate(zip(trees, paths)):
            if tree is None:
                continue
            first, _, tokens = tree
            del self.rows[b][first:]
            self.rows[b].extend(tokens[node] for node in path)
        self._trees = None

    def truncate(self, lengths: list[int]) -> None:
        for row, length in zip(self.rows, check_truncate(lengths, self.lengths)):
            del row[length:]

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
