"""Whole sequences: Algorithm 1 repeated, and the real decoding loop, give the target's
distribution over sequences (paper §2.3, A.1 applied position by position)."""

import pytest

from specdecode.models import TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import (SAMPLINGS, SMALL_CASES, MislabelledProposer, chi2_pvalue, loop_sequence_counts,
                     speculative_sequence_probs, target_sequence_probs)


@SMALL_CASES
@SAMPLINGS
def test_speculative_sequence_distribution_equals_target(vocab, k, length, params):
    target = TableModel(vocab, order=2, seed=10)
    draft = TableModel(vocab, order=2, seed=11)
    prompt = [0, 1]
    expected = target_sequence_probs(target, prompt, length, params)
    got = speculative_sequence_probs(target, draft, prompt, length, k, params)
    for seq, prob in expected.items():
        assert abs(got.get(seq, 0.0) - prob) < 1e-6, (seq, got.get(seq, 0.0), prob)


STAT_PARAMS = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.9)]


@pytest.mark.parametrize("params", STAT_PARAMS, ids=["t1", "t1-topk3", "t1-topp0.9"])
@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: DraftModelProposer(d, confidence_threshold=0.5),
    lambda d: FallbackProposer(PromptLookupProposer(4, max_ngram=2, min_ngram=1), DraftModelProposer(d)),
], ids=["fixed-gamma", "confidence-stop", "lookup+draft"])
@pytest.mark.slow
def test_decoding_loop_matches_target_distribution_chi_square(params, make_proposer):
    # 3000 seeded runs of the full loop (k=3, 3 tokens, vocab 4 → 64 sequences); the test fails
    # at significance 1e-3 (a correct implementation fails it 1 time in 1000).
    observed, probs = loop_sequence_counts(make_proposer, params, runs=3000)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.slow
def test_chi_square_test_detects_a_proposer_that_misreports_q():
    observed, probs = loop_sequence_counts(MislabelledProposer, SamplingParams(), runs=3000)
    assert chi2_pvalue(observed, probs) < 1e-6
