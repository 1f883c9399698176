"""A model defined by a table: next-token logits are a pure function of the last `order` tokens.

For tests: exact distributions are known, so sequence probabilities can be enumerated.
"""

from __future__ import annotations

import torch


class TableModel:
    """Logits from a seeded random table indexed by the last `order` tokens.

    Args:
        vocab_size: V.  order: context tokens the logits depend on (>= 1).
        seed: builds the table; two models with different seeds disagree.
        sharpness: scale of the random logits (larger → peakier distributions).
        max_length: context window, None for unbounded.
    """

    def __init__(self, vocab_size: int, order: int = 2, seed: int = 0, sharpness: float = 2.0,
                 max_length: int | None = None):
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.order = order
        self.max_length = max_length
        self.table = sharpness * torch.randn((vocab_size,) * order + (vocab_size,), generator=generator)
        self.tokens: list[int] = []
        self.num_forward_calls = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def logits_for(self, prefix: list[int] | tuple[int, ...]) -> torch.Tensor:
        """[V] float32 logits after `prefix` (left-padded with token 0 when shorter than order)."""
        context = ([0] * self.order + list(prefix))[-self.order:]
        return self.table[tuple(context)]

    def forward(self, tokens: torch.Tensor, num_logits: int) -> torch.Tensor:
        self.num_forward_calls += 1
        self.tokens.extend(tokens.tolist())
        end = len(self.tokens)
        return torch.stack([self.logits_for(self.tokens[:i]) for i in range(end - num_logits + 1, end + 1)])

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def reset(self) -> None:
        self.tokens = []


class BatchedTableModel:
    """B rows over one TableModel, with the batched backend interface of HFBatchedCausalLM
    (forward(feeds, num_logits) → [B, num_logits, V]; truncate(lengths); select(rows)). Logits
    are exactly the table's, so batched and single runs can be compared token for token."""

    def __init__(self, model: TableModel):
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_length = model.max_length
        self.num_forward_calls = 0
        self.start(1)

    def start(self, batch_size: int) -> None:
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(row) for row in self.rows], dtype=torch.long)

    def forward(self, feeds: list[list[int]], num_logits: int) -> torch.Tensor:
        if len(feeds) != len(self.rows) or not any(len(f) for f in feeds):
            raise ValueError(f"need {len(self.rows)} feeds, not all empty; got lengths {[len(f) for f in feeds]}")
        self.num_forward_calls += 1
        out = torch.zeros((len(feeds), num_logits, self.vocab_size))
        for b, feed in enumerate(feeds):
            row = self.rows[b]
            row.extend(int(t) for t in feed)
            # logits exist only after this row's new tokens; padding entries stay 0
            m = min(num_logits, len(feed))
            for j in range(m):
                out[b, num_logits - m + j] = self.model.logits_for(row[:len(row) - m + j + 1])
        return out

    def truncate(self, lengths: list[int]) -> None:
        for row, length in zip(self.rows, lengths):
            if length > len(row):
                raise ValueError(f"cannot truncate a row of {len(row)} tokens to {length}")
            del row[length:]

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
