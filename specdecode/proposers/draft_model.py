"""A small autoregressive model as the draft (paper §2.1, §3.6)."""

from __future__ import annotations

import time

import torch

from specdecode.proposers.base import Draft
from specdecode.sampling import SamplingParams, adjust, sample


class DraftModelProposer:
    """Samples k tokens one after another from a draft backend, with the request's adjustment.

    The draft's cache always holds the committed prefix minus the `pending` tokens it has not
    been fed yet (at first the whole prompt; later the target's last token and, after a fully
    accepted block, the last draft); they go in with the first forward of the next proposal, so
    prefill and rollback cost no extra call.

    Drafting stops early when the draft's own probability of the token it just chose falls below
    `confidence_threshold` (dynamic γ). The stopping rule looks only at the draft's side, so the
    output distribution is unchanged: each drafted position is still verified exactly.

    Args:
        backend: a model backend (specdecode.models) for the draft model.
        confidence_threshold: in [0, 1); 0 always drafts k tokens. The confidence is the draft's
            untempered softmax probability of the chosen token (also under greedy decoding).
    """

    def __init__(self, backend, confidence_threshold: float = 0.0):
        if not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.backend = backend
        self.confidence_threshold = confidence_threshold
        self.sampling = SamplingParams(temperature=0.0)
        self.generator: torch.Generator | None = None
        self.num_calls = 0
        self.time_s = 0.0

    def configure(self, sampling: SamplingParams, generator: torch.Generator) -> None:
        """Use the request's sampling settings and generator (DESIGN.md rules 1 and 7)."""
        self.sampling = sampling
        self.generator = generator

    def start(self, prompt: torch.Tensor) -> None:
        self.backend.reset()
        self._pending = prompt.tolist()
        self._drafts: list[int] = []
        self.num_calls = 0
        self.time_s = 0.0

    def propose(self, k: int) -> Draft:
        start = time.perf_counter()
        self._committed = self.backend.length + len(self._pending)
        if self.backend.max_length is not None:
            # the cache will hold the committed prefix and k − 1 drafts
            k = min(k, self.backend.max_length - self._committed + 1)
        if k <= 0:  # the draft's context window is full: this step goes without drafts
            return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, self.backend.vocab_size))
        feed, tokens, probs = self._pending, [], []
        for _ in range(k):
            logits = self.backend.forward(torch.tensor(feed, dtype=torch.long), 1)[0]
            self.num_calls += 1
            q = adjust(logits, self.sampling)
            token = int(q.argmax()) if self.sampling.greedy else int(sample(q, self.generator))
            tokens.append(token)
            probs.append(q)
            feed = [token]
            if self.confidence_threshold and len(tokens) < k and \
                    float(torch.softmax(logits, -1)[token]) < self.confidence_threshold:
                break
        self._pending, self._drafts = [], tokens
        self.time_s += time.perf_counter() - start
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs))

    def commit(self, num_accepted: int, tokens: list[int]) -> None:
        if not self._drafts:  # no proposal this step (k clipped to 0): just queue the tokens
            self._pending += tokens
            return
        # The cache holds the committed prefix plus drafts[:-1]; the last draft was never fed.
        kept = min(num_accepted, len(self._drafts) - 1)
        self.backend.truncate(self._committed + kept)
        self._pending = tokens[kept:]
        self._drafts = []
