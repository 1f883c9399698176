"""Token trees from a draft model (SpecInfer / Sequoia style; verified by verify.tree_step): where
the draft is unsure of its chain token, a few siblings beside it, scored by the target in the same
call at no draft forward.

Exactness: which positions branch and which siblings are drawn depend on the draft's side only (its
logits and the row's generator), and each sibling carries the q it was drawn from, so the tree
verifier keeps the target's distribution (paper §2.3 applied per node).
"""

from __future__ import annotations

import torch

from specdecode.sampling import SamplingParams, sample


def siblings(logits: torch.Tensor, q: torch.Tensor, token: int, width: int, sampling: SamplingParams,
             generator: torch.Generator | None) -> list[tuple[int, torch.Tensor]]:
    """Up to width − 1 alternatives to the chain token just drafted, each with its q.

    Args:
        logits: [V] the draft's logits at the position (after the row's logits pipeline).
        q: [V] float32, the adjusted distribution the chain token was drawn from.
        token: the chain token.  width: candidates at the position, the chain token included.
        sampling: the row's; greedy takes the draft's next-best ids, each with a one-hot q.
        generator: the row's; a sampled row draws the siblings from q without replacement
            (each drawn token removed and the rest renormalized), fewer if q runs out of mass.
    Returns:
        [(sibling id, its q [V] in q's dtype)], in the order drawn.
    """
    if sampling.greedy:
        order = logits.topk(min(width, logits.shape[-1])).indices.tolist()
        return [(t, torch.nn.functional.one_hot(torch.tensor(t, device=q.device), q.shape[-1]).to(q.dtype))
                for t in [t for t in order if t != token][:width - 1]]
    found, remaining, drawn = [], q, token
    for _ in range(width - 1):
        # without replacement: drop what was drawn, renormalize; each sibling keeps its own q
        remaining = remaining.clone()
        remaining[drawn] = 0.0
        mass = float(remaining.sum())
        if mass <= 0:
            break
        remaining = remaining / mass
        drawn = int(sample(remaining, generator))
        found.append((drawn, remaining))
    return found
