"""Trivial drafts (paper §3.6): unigram and bigram token models. They cost a table lookup (c ≈ 0),
so even a small α gives a speedup in the paper's model (a bigram with α = 0.2 at γ = 3:
1 + 0.2 + 0.04 + 0.008 ≈ 1.25X). Fitted on the text a run has at hand, their α measured 0.00-0.21
(docs/REPRODUCTION.md), so `specdecode alpha` measures them beside the draft model; the library's
free drafts are prompt lookup and suffix drafts."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable

import torch


class NGramModel:
    """Maximum-likelihood unigram (order 1) or bigram (order 2) model over token ids.

    The bigram is smoothed towards the unigram (a Dirichlet prior with the unigram as its mean,
    weight `prior`): q(x | a) = (c(a, x) + prior·u(x)) / (c(a) + prior). A context never seen
    gets u itself. Token ids never seen get q = 0: such a draft never proposes them, and the
    verifier's residual covers the mass it lacks (exact for any q). With no data, u is uniform.

    Args:
        vocab_size: V, the width of q.  order: 1 or 2.  prior: bigram smoothing weight (> 0).
    Raises:
        ValueError: order not 1 or 2, prior <= 0, a token id outside [0, V).
    """

    def __init__(self, vocab_size: int, order: int = 2, prior: float = 1.0):
        if order not in (1, 2):
            raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {order}")
        if prior <= 0:
            raise ValueError(f"prior must be > 0, got {prior}")
        self.vocab_size, self.order, self.prior = vocab_size, order, prior
        self.unigram_counts = torch.zeros(vocab_size, dtype=torch.float64)
        self.bigram_counts: dict[int, Counter] = defaultdict(Counter)

    def fit(self, sequences: Iterable[list[int]]) -> "NGramModel":
        """Add the counts of each token-id sequence (bigrams do not cross sequences). Returns self."""
        for seq in sequences:
            if not seq:
                continue
            ids = torch.as_tensor(seq, dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size})")
            self.unigram_counts += torch.bincount(ids, minlength=self.vocab_size).double()
            if self.order == 2:
                for a, b in zip(seq, seq[1:]):
                    self.bigram_counts[a][b] += 1
        self._unigram = None
        return self

    @property
    def num_tokens(self) -> int:
        return int(self.unigram_counts.sum())

    def unigram(self) -> torch.Tensor:
        """u: [V] float32, the unigram distribution (uniform if nothing was fitted)."""
        if getattr(self, "_unigram", None) is None:
            total = self.unigram_counts.sum()
            u = self.unigram_counts / total if total > 0 else torch.full((self.vocab_size,), 1.0 / self.vocab_size,
                                                                          dtype=torch.float64)
            self._unigram = u.float()
        return self._unigram

    def probs(self, previous: int | None) -> torch.Tensor:
        """q(· | previous): [V] float32 summing to 1 (the unigram for order 1 or an unseen context)."""
        u = self.unigram()
        following = self.bigram_counts.get(previous) if self.order == 2 and previous is not None else None
        if not following:
            return u
        q = u * self.prior
        ids = torch.tensor(list(following.keys()), dtype=torch.long)
        q = q.index_add(0, ids, torch.tensor(list(following.values()), dtype=torch.float32))
        return q / (sum(following.values()) + self.prior)
