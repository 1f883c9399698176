"""Where drafts come from. Every proposer returns the tokens and the distributions q they were
sampled from (one-hot for deterministic proposers), so there is one verify path.

    start(prompt [T] int64)          forget everything, take the prompt as the committed prefix
    propose(k) -> Draft              k draft tokens and their q
    commit(num_accepted, tokens)     the verifier kept the first num_accepted drafts and then the
                                     tokens in `tokens` (a list of ints, accepted + next token)
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] int64
    probs: torch.Tensor   # [k, V] float32; one-hot for deterministic proposers


class Proposer(Protocol):
    def start(self, prompt: torch.Tensor) -> None: ...
    def propose(self, k: int) -> Draft: ...
    def commit(self, num_accepted: int, tokens: list[int]) -> None: ...


from specdecode.proposers.draft_model import DraftModelProposer  # noqa: E402

__all__ = ["Draft", "Proposer", "DraftModelProposer"]
