"""Unigram / bigram drafts (paper §3.6): counts, smoothing, and the q they report."""

import pytest
import torch

from specdecode import SamplingParams
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import TableModel
from specdecode.proposers import NGramModel, NGramProposer


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


def test_bigram_proposer_drafts_from_the_previous_token_and_keeps_greedy_output():
    target = TableModel(6, order=1, seed=0)
    # fitted on the target's own greedy text, the bigram predicts it well
    plain = run(target, None, [1], DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0)))
    proposer = NGramProposer(NGramModel(6).fit([[1] + plain.token_ids]))
    spec = run(target, proposer, [1], DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0),
                                                   num_speculative_tokens=4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.alpha_estimate > 0.9 and spec.stats.num_draft_calls == 0  # no model forwards
