"""The §3 formulas against values printed in the paper (tables as transcribed in shared/paper.md)."""

import pytest
import torch

from specdecode import analysis as A


@pytest.mark.parametrize("alpha,gamma,ops,speed", [
    (0.6, 2, 1.53, 1.96), (0.7, 3, 1.58, 2.53), (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69), (0.9, 2, 1.11, 2.71), (0.9, 10, 1.60, 6.86)])
def test_table_1_operations_and_speed_with_free_draft(alpha, gamma, ops, speed):
    assert A.operations_factor(alpha, gamma, 0.0) == pytest.approx(ops, abs=0.005)
    assert A.walltime_improvement(alpha, gamma, 0.0) == pytest.approx(speed, abs=0.005)


@pytest.mark.parametrize("alpha,c,gamma,formula", [
    (0.75, 0.02, 7, 3.16), (0.80, 0.04, 7, 3.25), (0.82, 0.11, 7, 2.50), (0.62, 0.02, 7, 2.26),
    (0.68, 0.04, 5, 2.35), (0.71, 0.11, 3, 1.93), (0.65, 0.02, 5, 2.40), (0.73, 0.04, 5, 2.62),
    (0.74, 0.11, 3, 2.02), (0.53, 0.02, 5, 1.89), (0.55, 0.04, 3, 1.80), (0.56, 0.11, 3, 1.54)])
def test_table_4_theorem_3_8_column(alpha, c, gamma, formula):
    assert A.walltime_improvement(alpha, gamma, c) == pytest.approx(formula, abs=0.005)


def test_table_4_exp_column_within_paper_rounding():
    # "Exp" used unrounded α and c; the paper's notes put the formula within ~0.07 of it.
    for alpha, c, gamma, exp in [(0.75, 0.02, 7, 3.2), (0.82, 0.11, 7, 2.5), (0.53, 0.02, 5, 1.9)]:
        assert abs(A.walltime_improvement(alpha, gamma, c) - exp) < 0.07


@pytest.mark.parametrize("alpha,row", [
    (0.5, [1.50, 1.75, 1.88, 1.97, 1.99, 2.00]), (0.8, [1.80, 2.44, 2.95, 3.69, 4.16, 4.57]),
    (0.9, [1.90, 2.71, 3.44, 4.69, 5.70, 6.86])])
def test_equation_1_reference_values(alpha, row):
    for gamma, value in zip([1, 2, 3, 5, 7, 10], row):
        assert A.expected_tokens(alpha, gamma) == pytest.approx(value, abs=0.005)
    assert A.oracle_bound(alpha) == pytest.approx(1 / (1 - alpha))


@pytest.mark.parametrize("alpha,c,gamma,speed", [
    (0.5, 0.01, 5, 1.88), (0.6, 0.05, 4, 1.92), (0.7, 0.1, 4, 1.98), (0.8, 0.02, 11, 3.82),
    (0.8, 0.5, 2, 1.22), (0.9, 0.01, 24, 7.49), (0.9, 0.2, 7, 2.37), (0.5, 0.5, 1, 1.00)])
def test_optimal_gamma_table_of_section_3_5(alpha, c, gamma, speed):
    assert A.optimal_gamma(alpha, c) == gamma
    assert A.walltime_improvement(alpha, gamma, c) == pytest.approx(speed, abs=0.005)


def test_bigram_draft_example_and_greedy_lenience_speedups():
    assert A.walltime_improvement(0.2, 3, 0.0) == pytest.approx(1.248)  # §3.6: "about 1.25X"
    for alpha, speed in [(0.75, 3.30), (0.8, 3.87), (0.87, 4.91)]:  # A.5, c = 0.015, γ = 8
        assert A.walltime_improvement(alpha, 8, 0.015) == pytest.approx(speed, abs=0.005)


def test_corollary_3_9_speculation_pays_iff_alpha_above_c():
    for alpha, c in [(0.3, 0.2), (0.6, 0.37), (0.9, 0.05)]:
        assert A.speculation_pays(alpha, c)
        best = A.walltime_improvement(alpha, A.optimal_gamma(alpha, c), c)
        assert best >= A.speedup_lower_bound(alpha, c) > 1
    for alpha, c in [(0.2, 0.3), (0.37, 0.37)]:
        assert not A.speculation_pays(alpha, c)
        assert all(A.walltime_improvement(alpha, g, c) <= 1 + 1e-12 for g in range(1, 30))


def test_acceptance_rate_is_one_minus_total_variation():
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.3, 0.2])
    assert A.acceptance_rate(p, q).item() == pytest.approx(0.6)  # A.2's worked example
    assert A.total_variation(p, q).item() == pytest.approx(0.5 * (p - q).abs().sum().item())


@pytest.mark.parametrize("call,match", [
    (lambda: A.expected_tokens(1.2, 3), r"alpha must be in \[0, 1\], got 1.2"),
    (lambda: A.expected_tokens(0.5, 0), "gamma must be an integer >= 1, got 0"),
    (lambda: A.walltime_improvement(0.5, 2, -0.1), "c must be >= 0, got -0.1"),
    (lambda: A.optimal_gamma(0.5, 0.1, 0), "gamma must be an integer >= 1, got 0"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
