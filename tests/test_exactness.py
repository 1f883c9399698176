"""Whole sequences: Algorithm 1 repeated, and the real decoding loop, give the target's
distribution over sequences (paper §2.3, A.1 applied position by position)."""

import itertools
from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import TableModel
from specdecode.proposers import Draft, DraftModelProposer, NGramModel, NGramProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams, adjust
from specdecode.verify import acceptance_probs, residual_distribution

from conftest import chi2_pvalue


def target_sequence_probs(target, prompt, length, params):
    """P(s_1..s_L) = Π p(s_i | prompt + s_<i), over all sequences (chain rule)."""
    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(adjust(target.logits_for(prompt + list(seq[:i])), params)[seq[i]])
        probs[seq] = prob
    return probs


def speculative_sequence_probs(target, draft, prompt, length, k, params, lenience=1.0):
    """Exact distribution of the first `length` tokens emitted by Algorithm 1, enumerating every
    draft block and every accept/reject outcome, with γ clipped to the tokens still wanted
    (lenience < 1: the lossy acceptance min(1, p/(l·q)) of paper A.5, residual unchanged)."""
    out = Counter()

    def step(emitted, prob):
        if len(emitted) >= length:
            out[tuple(emitted[:length])] += prob
            return
        prefix = prompt + emitted
        k_step = min(k, length - len(emitted) - 1)
        for drafts in itertools.product(range(draft.vocab_size), repeat=k_step):
            q = [adjust(draft.logits_for(prefix + list(drafts[:i])), params) for i in range(k_step)]
            p = [adjust(target.logits_for(prefix + list(drafts[:i])), params) for i in range(k_step + 1)]
            q_block = 1.0
            for i in range(k_step):
                q_block *= float(q[i][drafts[i]])
            if q_block == 0:
                continue
            a = [float(acceptance_probs(torch.tensor([[drafts[i]]]), q[i].view(1, 1, -1), p[i].view(1, 1, -1), lenience))
                 for i in range(k_step)]
            accept_prefix = 1.0
            for n in range(k_step + 1):
                if n < k_step:
                    p_n = accept_prefix * (1 - a[n])
                    next_dist = residual_distribution(p[n], q[n])
                else:
                    p_n = accept_prefix
                    next_dist = p[k_step]
                for t in range(target.vocab_size):
                    if p_n * next_dist[t] > 0:
                        step(emitted + list(drafts[:n]) + [t], prob * q_block * p_n * float(next_dist[t]))
                if n < k_step:
                    accept_prefix *= a[n]

    step([], 1.0)
    return out


@pytest.mark.parametrize("vocab,k,length", [(3, 2, 3), (3, 3, 4), (4, 2, 3)])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=2),
                                    SamplingParams(top_p=0.8), SamplingParams(temperature=0)],
                         ids=["t1", "t0.7-topk2", "topp0.8", "greedy"])
def test_speculative_sequence_distribution_equals_target(vocab, k, length, params):
    target = TableModel(vocab, order=2, seed=10)
    draft = TableModel(vocab, order=2, seed=11)
    prompt = [0, 1]
    expected = target_sequence_probs(target, prompt, length, params)
    got = speculative_sequence_probs(target, draft, prompt, length, k, params)
    for seq, prob in expected.items():
        assert abs(got.get(seq, 0.0) - prob) < 1e-6, (seq, got.get(seq, 0.0), prob)


class MislabelledProposer(DraftModelProposer):
    """A broken proposer: samples from the draft but reports uniform q (violates rule 1)."""

    def propose(self, k):
        draft = super().propose(k)
        return Draft(draft.tokens, torch.full_like(draft.probs, 1.0 / draft.probs.shape[-1]))


def loop_sequence_counts(make_proposer, params, runs, vocab=4, k=3, length=3, **options):
    target = TableModel(vocab, order=2, seed=20, sharpness=1.5)
    draft = TableModel(vocab, order=2, seed=21, sharpness=1.5)
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=length, sampling=SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed),
            num_speculative_tokens=k, **options)
        counts[tuple(run(target, make_proposer(draft), [1, 2], config).token_ids)] += 1
    expected = target_sequence_probs(target, [1, 2], length, params)
    seqs = sorted(expected)
    return [counts[s] for s in seqs], [expected[s] for s in seqs]


STAT_PARAMS = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.9)]


@pytest.mark.parametrize("params", STAT_PARAMS, ids=["t1", "t1-topk3", "t1-topp0.9"])
@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: DraftModelProposer(d, confidence_threshold=0.5),
    lambda d: PromptLookupProposer(4, max_ngram=2, min_ngram=1, fallback=DraftModelProposer(d)),
    lambda d: NGramProposer(NGramModel(4, order=2).fit([[1, 2, 3, 1, 0, 2, 2, 3, 3]])),
], ids=["fixed-gamma", "confidence-stop", "lookup+draft", "bigram"])
def test_decoding_loop_matches_target_distribution_chi_square(params, make_proposer):
    # 3000 seeded runs of the full loop (k=3, 3 tokens, vocab 4 → 64 sequences); the test fails
    # at significance 1e-3 (a correct implementation fails it 1 time in 1000).
    observed, probs = loop_sequence_counts(make_proposer, params, runs=3000)
    assert chi2_pvalue(observed, probs) > 1e-3


def test_chi_square_test_detects_a_proposer_that_misreports_q():
    observed, probs = loop_sequence_counts(MislabelledProposer, SamplingParams(), runs=3000)
    assert chi2_pvalue(observed, probs) < 1e-6
