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
