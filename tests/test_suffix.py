"""Suffix drafts (SuffixDecoding): the index, the frequency walk, the cache of earlier requests
(bounded, least recently used, not read by seeded sampled requests), and exactness: greedy equal
to plain decoding on tiny Llamas, and a chi-square test of the sampled distribution through the
batched engine with the cache in use, and of later requests after earlier generate calls filled it
(suffix drafts alone), each with a negative control that fails it."""

import functools
from collections import Counter

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.engine.driver import run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer
from specdecode.proposers.base import Draft
from specdecode.proposers.suffix import SuffixIndex, SuffixProposer, continue_by_frequency
from specdecode.sampling import SamplingParams

from helpers import (UniformQFreeDrafts, greedy_continuation, model_sequence_probs, pooled_chi2_pvalue,
                     sequence_pvalues, tiny_llama)

GREEDY = SamplingParams(temperature=0)


class Row:
    def __init__(self, tokens, sampling=GREEDY):
        self.tokens, self.sampling = list(tokens), sampling


def test_the_walk_takes_the_most_frequent_continuation_while_it_is_likely_enough():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [1, 2, 6, 7]]
    occurrences = [(s, 2) for s in seqs]                 # after the match [1, 2]
    assert continue_by_frequency(occurrences, 8, 0.1) == [3, 4]     # 3: 3/4, then 4: 2/3 (product 0.5)
    assert continue_by_frequency(occurrences, 8, 0.6) == [3]        # 0.75, then 0.5 < 0.6: stop
    assert continue_by_frequency(occurrences, 1, 0.1) == [3]        # at most k
    assert continue_by_frequency(occurrences, 8, 0.8) == []


def test_the_index_tries_its_longest_level_and_forgets_removed_sequences():
    index = SuffixIndex(levels=(2, 4))
    index.append(1, [9, 1, 2, 3, 4, 5])
    index.append(2, [7, 7, 2, 3, 8])
    assert sorted(e for _, _, e in index.continuations((2, 3))) == [4, 4]
    assert [(i, e) for i, _, e in index.continuations((9, 1, 2, 3))] == [(1, 4)]
    index.append(2, [6])                                            # a row's output grows
    assert [s[e] for _, s, e in index.continuations((3, 8))] == [6]
    index.remove(1)
    assert [i for i, _, _ in index.continuations((2, 3))] == [2]
    assert index.continuations((9, 1, 2, 3)) == []


def test_finished_requests_draft_for_later_ones_within_a_bounded_cache():
    proposer = SuffixProposer(vocab_size=50, levels=(2, 4), cache_tokens=12)
    proposer.add_row([10, 11, 12, 13, 14, 15, 16, 17])
    proposer.select([])                                             # it finished: cached
    proposer.add_row([1, 2, 12, 13])
    drafts = proposer.propose([Row([1, 2, 12, 13])], [4])
    assert drafts[0].tokens.tolist() == [14, 15, 16, 17] and drafts[0].lookup
    seeded = Row([1, 2, 12, 13], SamplingParams(temperature=1.0, seed=3))
    assert proposer.propose([seeded], [4])[0].tokens.tolist() == []   # seeded: its own tokens only
    unseeded = Row([1, 2, 12, 13], SamplingParams(temperature=1.0))
    assert proposer.propose([unseeded], [4])[0].tokens.tolist() == [14, 15, 16, 17]
    proposer.select([])
    proposer.add_row([20, 21, 22, 23, 24, 25, 26, 27, 28])          # 4 + 9 > 12 tokens: the oldest goes
    proposer.select([])
    proposer.add_row([5, 12, 13])
    assert proposer.propose([Row([5, 12, 13])], [4])[0].tokens.tolist() == []
    assert proposer.propose([Row([5, 24, 25])], [4])[0].tokens.tolist() == [26, 27, 28]
    assert drafts[0].support == 2  # the 2-token match [12, 13] (no 4-token one)
    proposer.forget()  # earlier requests gone; the running row keeps its own tokens
    assert proposer.propose([Row([5, 24, 25])], [4])[0].tokens.tolist() == []


def test_a_row_drafts_from_its_own_prompt_and_output():
    proposer = SuffixProposer(vocab_size=50, levels=(2, 3), cache_tokens=0)
    proposer.add_row([4, 5, 6, 7, 4, 5])
    assert proposer.propose([Row([4, 5, 6, 7, 4, 5])], [8])[0].tokens.tolist() == [6, 7, 4, 5]  # 2·2 tokens
    proposer.commit([0], [[6]])
    # a 3-token match now: up to 6 tokens, running on into its own latest ones (a period)
    assert proposer.propose([Row([4, 5, 6, 7, 4, 5, 6])], [8])[0].tokens.tolist() == [7, 4, 5, 6]


def test_suffix_drafts_keep_greedy_output_equal_to_plain_decoding_on_tiny_llamas():
    target, draft = HFCausalLM(tiny_llama(0)), HFCausalLM(tiny_llama(1))
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8], [1, 2, 3, 4]]
    plain = [r.token_ids for r in run_all(target, None, [Request(p, DecodeConfig(24, GREEDY)) for p in prompts])]
    proposer = FallbackProposer(SuffixProposer(target.vocab_size), DraftModelProposer(draft))
    for _ in range(2):  # the second time, the first run's outputs are in the cache
        results = run_all(target, proposer, [Request(p, DecodeConfig(24, GREEDY, num_speculative_tokens=4))
                                             for p in prompts])
        assert [r.token_ids for r in results] == plain
    assert sum(r.stats.num_lookup_steps for r in results) > 0


class WrongQ(SuffixProposer):
    """A broken proposer: it claims q is one-hot on a different token than the one it proposes."""

    def propose(self, rows, ks):
        drafts = super().propose(rows, ks)
        return [Draft(d.tokens, torch.roll(d.probs, 1, dims=-1), d.forwards, d.lookup) if d.lookup else d
                for d in drafts]


def suffix_pvalues(proposer_class, batches, costs=None):
    """Three prompts per batch through one engine per batch; the same proposer throughout, so later
    batches draft from earlier ones' outputs (share_seeded: seeded rows read the cache too).
    costs: the guard's (c, slope): each row's free drafts are then priced (engine.guard)."""
    vocab, length = 4, 3
    target = TableModel(vocab, order=2, seed=20, sharpness=1.5)
    draft = TableModel(vocab, order=2, seed=21, sharpness=1.5)
    prompts = [[1, 2, 1, 2], [3, 0, 3], [0, 2, 1, 3, 0, 2]]
    proposer = FallbackProposer(proposer_class(vocab, levels=(1, 2), share_seeded=True), DraftModelProposer(draft))
    counts, lookups, declined = [Counter() for _ in prompts], 0, 0
    for run_index in range(batches):
        configs = [DecodeConfig(length, SamplingParams(seed=3 * run_index + i), num_speculative_tokens=3, costs=costs)
                   for i in range(len(prompts))]
        for i, result in enumerate(run_all(target, proposer, [Request(p, c) for p, c in zip(prompts, configs)])):
            counts[i][tuple(result.token_ids)] += 1
            lookups += result.stats.num_lookup_steps
            declined += result.stats.num_free_declined
    return sequence_pvalues(target, prompts, counts, length), lookups, declined


@pytest.mark.slow
def test_suffix_drafts_with_the_cache_match_the_target_distribution_chi_square():
    # 1000 batches of 3 rows (vocab 4, 3 tokens: 64 sequences per prompt), seeds 0..2999;
    # each prompt's test fails at significance 1e-3.
    pvalues, lookups, _ = suffix_pvalues(SuffixProposer, 1000)
    assert min(pvalues) > 1e-3 and lookups > 1000


@pytest.mark.slow
def test_priced_suffix_drafts_match_the_target_distribution_chi_square():
    # the same, with the guard pricing each free draft by the row's record (slope 0.4: a 1-token
    # match's draft is declined, a 2-token one's cut to 1 token, then declined after a rejection
    # or widened after an acceptance); the power check below is the same size
    pvalues, lookups, declined = suffix_pvalues(SuffixProposer, 1000, costs=(0.3, 0.4))
    assert min(pvalues) > 1e-3 and lookups > 500 and declined > 100


@pytest.mark.slow
def test_chi_square_detects_a_suffix_proposer_whose_q_is_not_what_it_proposed():
    # 300 batches: the exact test's bar (every prompt above 1e-3) fails by far (p < 1e-30 seen)
    pvalues, _, _ = suffix_pvalues(WrongQ, 300)
    assert min(pvalues) < 1e-6


# --- the cache across generate calls of one decoder (suffix drafts alone) ----------------------------

CONTEXT = [11, 10, 9, 8, 7, 6]  # "hgfedc": no token twice, so a request on it finds no match in its own tokens
LENGTH, LATER = 3, 800          # 800 later outputs of 3 tokens, in calls of n=16
SAMPLED = SamplingParams(temperature=1.0, ignore_eos=True)  # unseeded: reads the cache; every output 3 tokens


def warm_then_sample(decoder, model):
    """A first request on CONTEXT (cold cache), 30 whose prompts repeat CONTEXT and its greedy
    continuation 4-6 times, a seeded one on CONTEXT, then LATER unseeded ones on CONTEXT.
    Returns (cold's drafts, seeded's drafts, the later ones' drafts, Counter of their outputs)."""
    generate = functools.partial(decoder.generate, max_new_tokens=LENGTH, sampling=SAMPLED)
    cold = generate(CONTEXT).stats.num_drafted
    continuation = greedy_continuation(model, CONTEXT, 4)
    for i in range(30):
        generate((CONTEXT + continuation) * (4 + i % 3))
    seeded = generate(CONTEXT, sampling=SamplingParams(temperature=1.0, seed=5, ignore_eos=True)).stats.num_drafted
    counts, drafted = Counter(), 0
    for _ in range(LATER // 16):
        for result in generate(CONTEXT, n=16):
            counts[tuple(result.token_ids)] += 1
            drafted += result.stats.num_drafted
    return cold, seeded, drafted, counts


@pytest.mark.slow
def test_earlier_generate_calls_make_a_later_one_draft_and_its_output_stays_exact_chi_square(peaked):
    """draft=None, free_drafts="suffix": nothing drafts on a cold cache; after the earlier calls,
    later unseeded requests draft from them (from their second token: a request's first step
    is plain, and a step leaves room for the target's own token), a seeded one only from its own
    tokens (none here). The later outputs follow the target's exact distribution (chi-square,
    800 samples, sequences expected fewer than 5 times pooled; fails below 1e-3)."""
    model, path = peaked
    decoder = SpeculativeDecoder(path, None, dtype="float32", free_drafts="suffix", guard=False)
    cold, seeded, drafted, counts = warm_then_sample(decoder, model)
    assert cold == 0 and seeded == 0 and drafted > LATER // 2
    pvalue, categories = pooled_chi2_pvalue(counts, model_sequence_probs(model, CONTEXT, LENGTH))
    assert pvalue > 1e-3 and categories >= 10


@pytest.mark.slow
def test_the_warm_cache_chi_square_detects_free_drafts_whose_q_is_misreported(peaked):
    # the same test with uniform q reported for the cache's drafts: p < 1e-50 seen
    model, path = peaked
    decoder = SpeculativeDecoder(path, None, dtype="float32", free_drafts="suffix", guard=False)
    decoder.engine.proposer = UniformQFreeDrafts(decoder.engine.proposer)
    _, _, drafted, counts = warm_then_sample(decoder, model)
    assert drafted > LATER // 2
    assert pooled_chi2_pvalue(counts, model_sequence_probs(model, CONTEXT, LENGTH))[0] < 1e-6
