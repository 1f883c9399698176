"""The paper's analysis (§3): acceptance rate, expected tokens per target call, walltime and
operations factors, and the best γ. Pure functions of numbers and tensors."""

from __future__ import annotations

import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) over the last dim (paper Thm 3.5); α is its mean over prefixes (Cor. 3.6).

    Args:
        p: [..., V] float, target distributions.  q: [..., V] float, draft distributions.
    Returns:
        [...] float in [0, 1].
    """
    return torch.minimum(p, q).sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """D_LK(p, q) = 1 − Σ min(p, q), the total variation distance (paper Def. 3.2, Lemma 3.3)."""
    return 1.0 - acceptance_rate(p, q)


def _check_alpha(alpha: float) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _check_gamma(gamma: int) -> None:
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per target call, (1 − α^{γ+1}) / (1 − α) (paper Eq. 1; i.i.d. acceptances).

    Raises:
        ValueError: alpha outside [0, 1] or gamma < 1.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    return float(gamma + 1) if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup over the target alone, (1 − α^{γ+1}) / ((1 − α)(γc + 1)) (paper Thm 3.8).

    c is the cost coefficient: time of one draft step / time of one target step (Def. 3.7).
    Assumes a (γ+1)-token target call costs as much as a 1-token one (§3.3).
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def speculation_pays(alpha: float, c: float) -> bool:
    """Some γ gives a speedup iff α > c (paper Cor. 3.9)."""
    _check_alpha(alpha)
    return alpha > c


def speedup_lower_bound(alpha: float, c: float) -> float:
    """(1 + α) / (1 + c): the speedup at γ = 1, a lower bound on the best speedup when α > c (Cor. 3.9)."""
    return walltime_improvement(alpha, 1, c)


def operations_factor(alpha: float, gamma: int, c_hat: float) -> float:
    """Expected factor of increase in arithmetic operations, (1 − α)(γĉ + γ + 1) / (1 − α^{γ+1})
    (paper Thm 3.11); ĉ is the draft/target ratio of operations per token (Def. 3.10)."""
    return (gamma * c_hat + gamma + 1) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The integer γ in [1, max_gamma] that maximizes Thm 3.8's speedup (paper §3.5; ties → smaller γ)."""
    _check_gamma(max_gamma)
    return max(range(1, max_gamma + 1), key=lambda g: (walltime_improvement(alpha, g, c), -g))


def oracle_bound(alpha: float) -> float:
    """1 / (1 − α): expected tokens per call with an oracle choosing γ, or as γ → ∞ (paper §3.5)."""
    _check_alpha(alpha)
    return float("inf") if alpha == 1 else 1 / (1 - alpha)
