"""The proposer protocol: where drafts come from does not matter to the loop (STYLE.md habit 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k'] int64, 0 <= k' <= k (a proposer may stop early or have nothing)
    probs: torch.Tensor   # [k', V] float32, the q each token was sampled from; one-hot if deterministic


class Proposer(Protocol):
    num_calls: int   # draft forward passes so far in this request
    time_s: float    # seconds spent proposing in this request

    def configure(self, sampling: SamplingParams, generator: torch.Generator) -> None:
        """Sample with the request's settings and generator (DESIGN.md rules 1 and 7)."""

    def start(self, prompt: torch.Tensor) -> None:
        """Forget everything; the prompt [T] int64 is the committed prefix."""

    def propose(self, k: int) -> Draft:
        """Up to k draft tokens continuing the committed prefix, with their q."""

    def commit(self, num_accepted: int, tokens: list[int]) -> None:
        """The verifier kept the first num_accepted drafts; `tokens` (the accepted drafts and
        the target's next token) now extend the committed prefix."""
