"""One speculative step, exactly (paper §2.3, Appendix A.1)."""

import pytest
import torch
from specdecode.sampling import SamplingParams, adjust
from specdecode.verify import acceptance_probs, residual_distribution, speculative_step

from helpers import chi2_pvalue, random_probs


def step_output_distribution(p, q, lenience=1.0, residual=residual_distribution):
    """Exact distribution of the token one step emits at the first position, k = 1:
    sum over the drafted x ~ q of [accept → x] + [reject → residual]."""
    vocab = p.shape[-1]
    out = torch.zeros(vocab, dtype=torch.float64)
    res = residual(p, q).double()
    for x in range(q.shape[-1]):
        if q[x] == 0:
            continue
        a = acceptance_probs(torch.tensor([[x]]), q.view(1, 1, -1), p.view(1, 1, -1), lenience)[0, 0].double()
        if x < vocab:
            out[x] += q[x].double() * a
        out += q[x].double() * (1 - a) * res
    return out


def cases():
    g = torch.Generator().manual_seed(0)
    v = 7
    yield "random", random_probs(v, g), random_probs(v, g)
    p = random_probs(v, g)
    yield "p equals q", p, p.clone()
    yield "disjoint supports", torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0.]), torch.tensor([0, 0, 0.2, 0.3, 0.5, 0, 0.])
    yield "one-hot p", torch.nn.functional.one_hot(torch.tensor(3), v).float(), random_probs(v, g)
    yield "one-hot both, agree", torch.eye(v)[2], torch.eye(v)[2]
    yield "one-hot both, differ", torch.eye(v)[2], torch.eye(v)[5]
    logits_p, logits_q = torch.randn(v, generator=g), torch.randn(v, generator=g)
    params = SamplingParams(temperature=0.8, top_k=3)
    yield "top-k zeroed supports", adjust(logits_p, params), adjust(logits_q, params)
    params = SamplingParams(top_p=0.6)
    yield "top-p zeroed supports", adjust(logits_p, params), adjust(logits_q, params)
    yield "draft vocab smaller (padded)", random_probs(v, g), random_probs(v - 2, g)
    yield "draft vocab larger (cut)", random_probs(v, g), random_probs(v + 3, g)
    for i in range(40):
        yield f"random sparse {i}", random_probs(v, g, zero_frac=0.4), random_probs(v, g, zero_frac=0.4)


@pytest.mark.parametrize("name,p,q", list(cases()), ids=[c[0] for c in cases()])
def test_one_step_output_is_exactly_p(name, p, q):
    out = step_output_distribution(p, q)
    assert torch.allclose(out, p.double(), atol=1e-6), (name, out, p)


def test_enumeration_catches_a_wrong_residual():
    # The check above has power: resampling from p instead of the residual is off by far more than 1e-6.
    g = torch.Generator().manual_seed(1)
    p, q = random_probs(7, g), random_probs(7, g)
    wrong = step_output_distribution(p, q, residual=lambda p, q: p)
    assert (wrong - p.double()).abs().max() > 1e-2


def test_acceptance_rate_is_sum_of_min_p_q():
    # Thm 3.5: β = Σ_x min(p, q) = E_{x~q}[min(1, p/q)]
    g = torch.Generator().manual_seed(2)
    p, q = random_probs(9, g), random_probs(9, g)
    a = acceptance_probs(torch.arange(9).view(1, 9), q.expand(1, 9, 9), p.expand(1, 10, 9))
    assert torch.isclose((q * a[0]).sum(), torch.minimum(p, q).sum(), atol=1e-6)


def test_speculative_step_samples_p_statistically():
    # The sampling step itself, run on 200k identical rows of a k=2 block: the first emitted token
    # (x1 if accepted, else the replacement) must follow p_1. Chi-square at significance 1e-4.
    g = torch.Generator().manual_seed(3)
    v, batch = 6, 200_000
    p = random_probs((3, v), g)
    q = random_probs((2, v), g)
    drafts = torch.multinomial(q, batch, replacement=True, generator=g).T  # [B, 2]
    n, token = speculative_step(drafts, q.expand(batch, 2, v), p.expand(batch, 3, v), generator=g)
    first = torch.where(n > 0, drafts[:, 0], token)
    observed = torch.bincount(first, minlength=v).double()
    assert chi2_pvalue(observed, p[0]) > 1e-4
    # and the second token, given the first draft was accepted, follows p_2
    second = torch.where(n > 1, drafts[:, 1], token)[n >= 1]
    observed = torch.bincount(second, minlength=v).double()
    assert chi2_pvalue(observed, p[1]) > 1e-4


def test_all_accepted_gives_bonus_from_last_target_position():
    p = torch.stack([torch.eye(5)[1], torch.eye(5)[2], torch.eye(5)[4]]).unsqueeze(0)
    q = torch.stack([torch.eye(5)[1], torch.eye(5)[2]]).unsqueeze(0)
    n, token = speculative_step(torch.tensor([[1, 2]]), q, p)
    assert (int(n), int(token)) == (2, 4)


def test_first_rejection_stops_the_block_and_greedy_corrects_to_target_argmax():
    p = torch.stack([torch.eye(5)[1], torch.eye(5)[3], torch.eye(5)[4]]).unsqueeze(0)
    q = torch.stack([torch.eye(5)[1], torch.eye(5)[2]]).unsqueeze(0)
    n, token = speculative_step(torch.tensor([[1, 2]]), q, p)
    assert (int(n), int(token)) == (1, 3)


def test_residual_falls_back_to_p_when_p_equals_q():
    p = torch.tensor([0.2, 0.3, 0.5])
    assert torch.equal(residual_distribution(p, p.clone()), p)


def test_drafted_token_with_zero_q_is_rejected_without_nan():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    a = acceptance_probs(torch.tensor([[1]]), q, p)
    assert a.tolist() == [[0.0]]
    n, token = speculative_step(torch.tensor([[1]]), q, p, generator=torch.Generator().manual_seed(0))
    assert int(n) == 0 and int(token) in (0, 1)


def test_draft_id_outside_target_vocab_is_rejected():
    p = torch.full((1, 2, 4), 0.25)
    q = torch.zeros(1, 1, 6)
    q[0, 0, 5] = 1.0
    assert acceptance_probs(torch.tensor([[5]]), q, p).tolist() == [[0.0]]
    n, token = speculative_step(torch.tensor([[5]]), q, p, generator=torch.Generator().manual_seed(0))
    assert int(n) == 0 and 0 <= int(token) < 4


def test_bad_shapes_raise_with_all_three_shapes():
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(1, 2, 5\).*\(1, 2, 5\)"):
        speculative_step(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))


@pytest.mark.parametrize("lenience", [0.5, 0.3, 0.1])
def test_lenience_never_exceeds_p_over_l(lenience):
    # paper A.5: no token is emitted with probability above p(x)/l; l = 1 is the exact rule.
    g = torch.Generator().manual_seed(4)
    for _ in range(30):
        p, q = random_probs(6, g, zero_frac=0.3), random_probs(6, g, zero_frac=0.3)
        out = step_output_distribution(p, q, lenience)
        assert torch.allclose(out.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6)
        assert (out <= p.double() / lenience + 1e-6).all()
        assert torch.allclose(step_output_distribution(p, q, 1.0), p.double(), atol=1e-6)


def test_lenience_matches_papers_worked_example():
    # paper §6.5 (A.5): l = 0.5, p = (0.1, 0.6, 0.3), q = (0.5, 0.3, 0.2) → (0.2, 0.525, 0.275)
    out = step_output_distribution(torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.5, 0.3, 0.2]), 0.5)
    assert torch.allclose(out, torch.tensor([0.2, 0.525, 0.275], dtype=torch.float64), atol=1e-6)
