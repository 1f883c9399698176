"""Unigram / bigram models (paper §3.6, measured by `specdecode alpha`): counts, smoothing, and the q they give."""

import pytest
import torch

from specdecode.proposers import NGramModel


def test_unigram_is_the_token_frequency_and_uniform_without_data():
    assert torch.allclose(NGramModel(4, order=1).unigram(), torch.full((4,), 0.25))
    model = NGramModel(5, order=1).fit([[1, 1, 2], [1, 4]])
    assert torch.allclose(model.probs(1), torch.tensor([0, 0.6, 0.2, 0, 0.2]))
    assert model.num_tokens == 5


def test_bigram_is_smoothed_towards_the_unigram_and_does_not_cross_sequences():
    model = NGramModel(4, order=2, prior=1.0).fit([[0, 1, 0, 1, 2], [3]])
    u = torch.tensor([2, 2, 1, 1]) / 6
    # after 0: c(0,1) = 2 of c(0) = 2, plus one pseudo-count spread as u
    assert torch.allclose(model.probs(0), (torch.tensor([0, 2, 0, 0]) + u) / 3)
    assert torch.allclose(model.probs(2), u)  # 2 is never followed: its context is unseen
    assert torch.allclose(model.probs(None), u)
    assert model.probs(1).sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs,match", [(dict(order=3), "order"), (dict(prior=0), "prior")])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NGramModel(4, **kwargs)
    with pytest.raises(ValueError, match="token ids"):
        NGramModel(4).fit([[0, 4]])
