"""logit_bias, min_tokens, ignore_eos, prompt logprobs and n: what evaluation harnesses send, each
exact under speculation (chi-square on table models with a negative control, greedy equality
with plain decoding and with a reference loop in float32)."""

import itertools
from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run, run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.processors import LogitBias, MinTokens
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams, adjust

from helpers import PROMPT, chi2_pvalue, tiny_llama

EOS = 0
BIAS = {1: 1.5, 3: -1.0, 2: -100.0}  # -100 bans token 2 in effect


def _sequence_probs(target, prompt, length, sampling, eos=None):
    """{sequence: probability} by the definitions: OpenAI's logit_bias added to the raw logits,
    EOS banned before min_tokens; a sequence ends at EOS (when eos is given) or after `length`."""
    probs = {}

    def walk(seq, prob):
        if len(seq) == length or (seq and seq[-1] == eos):
            probs[tuple(seq)] = probs.get(tuple(seq), 0.0) + prob
            return
        logits = target.logits_for(prompt + seq).clone()
        for token, bias in (sampling.logit_bias or {}).items():
            logits[token] += bias
        if eos is not None and len(seq) < sampling.min_tokens:
            logits[eos] = float("-inf")
        p = adjust(logits, sampling)
        for token in range(target.vocab_size):
            if p[token] > 0:
                walk(seq + [token], prob * float(p[token]))

    walk([], 1.0)
    return probs


def _counts(sampling, runs, eos=None, make_proposer=lambda d: DraftModelProposer(d), **engine_options):
    target, draft = TableModel(4, order=2, seed=30, sharpness=1.5), TableModel(4, order=2, seed=31, sharpness=1.5)
    counts = Counter()
    eos_ids = frozenset() if eos is None else frozenset({eos})
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=3, sampling=SamplingParams(
            logit_bias=sampling.logit_bias, min_tokens=sampling.min_tokens, seed=seed), num_speculative_tokens=3,
            eos_token_ids=eos_ids)
        counts[tuple(run(target, make_proposer(draft), [1, 2], config, **engine_options).token_ids)] += 1
    expected = _sequence_probs(target, [1, 2], 3, sampling, eos)
    seqs = sorted(set(expected) | set(counts))
    return [counts[s] for s in seqs], [expected.get(s, 0.0) for s in seqs]


BIASED = SamplingParams(logit_bias=BIAS)
AT_LEAST_2 = SamplingParams(min_tokens=2)


@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: FallbackProposer(PromptLookupProposer(4, max_ngram=2, min_ngram=1), DraftModelProposer(d)),
], ids=["draft", "lookup+draft"])
@pytest.mark.parametrize("sampling, eos", [(BIASED, None), (AT_LEAST_2, EOS)], ids=["logit_bias", "min_tokens"])
@pytest.mark.slow
def test_sampling_matches_the_transformed_target_chi_square(sampling, eos, make_proposer):
    # 3000 seeded runs (vocab 4, up to 3 tokens); significance 1e-3
    observed, probs = _counts(sampling, 3000, eos, make_proposer)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.parametrize("sampling, eos", [(BIASED, None), (AT_LEAST_2, EOS)], ids=["logit_bias", "min_tokens"])
@pytest.mark.slow
def test_chi_square_detects_a_transform_that_reaches_the_draft_only(sampling, eos):
    # the test has power: p without the bias (or the EOS mask) while q keeps it is caught. (The
    # opposite, p with it and q without, stays exact: the rejection rule corrects any q.)
    from specdecode.engine.engine import accept

    observed, probs = _counts(sampling, 3000, eos, accept_rule=lambda d, q, logits, config, gen, committed,
                              pipeline=None: accept(d, q, logits, config, gen, committed))
    assert chi2_pvalue(observed, probs) < 1e-6


def test_min_tokens_masks_eos_exactly_until_the_minimum():
    mask = MinTokens(3, {0, 7}, prompt_len=2, vocab_size=5)   # 7 is outside the vocabulary: ignored
    logits = mask([9, 9, 4], [1, 2], torch.zeros(3, 5))      # rows: 1, 2, 3 generated before
    assert torch.isinf(logits[:, 0]).tolist() == [True, True, False]
    logits = mask([9, 9], [], torch.zeros(1, 5))
    assert torch.isinf(logits[0, 0]) and not torch.isinf(logits[0, 1:]).any()


def test_logit_bias_is_checked_and_added():
    logits = LogitBias({1: 2.0, 3: -1.0}, 4)([], [], torch.zeros(2, 4))
    assert logits.tolist() == [[0.0, 2.0, 0.0, -1.0]] * 2
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitBias({4: 1.0}, 4)
    for bad in ({-1: 1.0}, {1: 101}, {True: 1.0}, {1: "x"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(TypeError, match="logit_bias"):
        SamplingParams(logit_bias=[1, 2])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(TypeError, match="ignore_eos"):
        SamplingParams(ignore_eos=1)


# --- greedy: speculative equals plain and a reference loop (float32) -----------------------------

@pytest.fixture(scope="module")
def llamas():
    return tiny_llama(0, layers=2), tiny_llama(1, layers=1)


def _reference_greedy(model, prompt, n, transform, eos=None):
    tokens = list(prompt)
    with torch.no_grad():
        for i in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            tokens.append(int(transform(i, logits).argmax()))
            if tokens[-1] == eos:
                break
    return tokens[len(prompt):]


def test_logit_bias_greedy_speculative_equals_plain_and_reference(llamas):
    target_model, draft_model = llamas
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    plain_tokens = run(target, None, PROMPT, DecodeConfig(40, SamplingParams(temperature=0))).token_ids
    bias = {plain_tokens[0]: -100.0, plain_tokens[5]: -3.0, 7: 4.0}
    sampling = SamplingParams(temperature=0, logit_bias=bias)
    spec = run(target, DraftModelProposer(draft), PROMPT, DecodeConfig(40, sampling, num_speculative_tokens=4))
    plain = run(target, None, PROMPT, DecodeConfig(40, sampling))

    def transform(_, logits):
        for token, value in bias.items():
            logits[token] += value
        return logits

    assert spec.token_ids == plain.token_ids == _reference_greedy(target_model, PROMPT, 40, transform)
    assert plain.token_ids != plain_tokens and plain.token_ids[0] != plain_tokens[0]
    assert spec.stats.num_drafted > 0


def test_min_tokens_and_ignore_eos_greedy_speculative_equal_plain(llamas):
    target_model, draft_model = llamas
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    free = run(target, None, PROMPT, DecodeConfig(30, SamplingParams(temperature=0))).token_ids
    eos = free[3]  # a token greedy emits early: as EOS it would end the output at 4 tokens
    config = DecodeConfig(30, SamplingParams(temperature=0), eos_token_ids=frozenset({eos}))
    assert len(run(target, None, PROMPT, config).token_ids) == 4
    for sampling, expect_len in ((SamplingParams(temperature=0, min_tokens=12), None),
                                 (SamplingParams(temperature=0, ignore_eos=True), 30)):
        config = DecodeConfig(30, sampling, eos_token_ids=frozenset({eos}))
        spec = run(target, DraftModelProposer(draft), PROMPT, DecodeConfig(30, sampling, 4, frozenset({eos})))
        plain = run(target, None, PROMPT, config)

        def transform(i, logits):
            if i < sampling.min_tokens:
                logits[eos] = float("-inf")
            return logits

        reference = _reference_greedy(target_model, PROMPT, 30, transform, None if sampling.ignore_eos else eos)
        assert spec.token_ids == plain.token_ids == reference
        if sampling.min_tokens:  # EOS masked until the minimum
            assert len(plain.token_ids) >= 12 and eos not in plain.token_ids[:12]
        if expect_len:  # EOS emitted and decoding went on
            assert len(plain.token_ids) == expect_len and eos in plain.token_ids and plain.finish_reason == "length"


# --- prompt logprobs ----------------------------------------------------------------------------

def test_prompt_logprobs_equal_a_plain_transformers_forward_and_zero_tokens_only_scores(llamas):
    target_model, draft_model = llamas
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    with torch.no_grad():
        reference = torch.log_softmax(target_model(torch.tensor([PROMPT])).logits[0].float(), -1)
    config = DecodeConfig(8, SamplingParams(temperature=0), num_speculative_tokens=3, prompt_logprobs=2)
    other = DecodeConfig(8, SamplingParams(temperature=0), num_speculative_tokens=3)
    scored_only = DecodeConfig(0, SamplingParams(temperature=0), prompt_logprobs=0)
    # with other rows in the batch, and a request that only scores
    results = run_all(target, DraftModelProposer(draft), [Request(PROMPT, config), Request(PROMPT[:5], other),
                                                          Request(PROMPT, scored_only)])
    entries = results[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(PROMPT)
    for j, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == PROMPT[j]
        assert entry.logprob == pytest.approx(float(reference[j - 1, PROMPT[j]]), abs=1e-5)
        top = reference[j - 1].topk(2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
    assert results[0].token_ids == run(target, None, PROMPT, DecodeConfig(8, SamplingParams(temperature=0))).token_ids
    assert results[1].prompt_logprobs is None
    only = results[2]
    assert only.token_ids == [] and only.finish_reason == "length" and only.stats.num_target_calls == 0
    assert [e.logprob for e in only.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-6)


def test_prompt_logprobs_of_a_table_model_are_its_table():
    target = TableModel(6, order=2, seed=3)
    result = run(target, None, [1, 2, 3, 4], DecodeConfig(0, SamplingParams(), prompt_logprobs=1))
    for j in (1, 2, 3):
        expected = torch.log_softmax(target.logits_for([1, 2, 3, 4][:j]), -1)
        assert result.prompt_logprobs[j].logprob == pytest.approx(float(expected[[1, 2, 3, 4][j]]))


def test_seeded_choices_of_one_request_are_their_own_seeds():
    from specdecode.frontend.builder import choice_samplings

    base = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert [s.seed for s in choice_samplings(base, 3)] == [2**64 - 1, 0, 1]
    assert choice_samplings(SamplingParams(), 3) == [SamplingParams()] * 3
    target, draft = TableModel(8, seed=1), TableModel(8, seed=2)
    samplings = choice_samplings(SamplingParams(seed=5), 4)
    together = run_all(target, DraftModelProposer(draft),
                       [Request([1, 2], DecodeConfig(20, s, num_speculative_tokens=3)) for s in samplings])
    alone = [run(target, DraftModelProposer(draft), [1, 2], DecodeConfig(20, s, num_speculative_tokens=3))
             for s in samplings]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in together}) == 4
    assert list(itertools.chain(*(r.token_ids for r in together)))  # something was generated


def test_prompt_logprobs_of_a_prompt_longer_than_one_scoring_chunk(llamas, monkeypatch):
    """A long prompt is scored in chunks of positions (never all its logits at once): the entries
    still equal one transformers forward."""
    target_model, _ = llamas
    target = HFCausalLM(target_model)
    monkeypatch.setattr(HFCausalLM, "SCORE_CHUNK", 5)
    prompt = (PROMPT * 4)[:23]
    with torch.no_grad():
        reference = torch.log_softmax(target_model(torch.tensor([prompt])).logits[0].float(), -1)
    entries = run(target, None, prompt, DecodeConfig(0, SamplingParams(temperature=0), prompt_logprobs=1)).prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert [e.logprob for e in entries[1:]] == pytest.approx([float(reference[j - 1, prompt[j]])
                                                              for j in range(1, len(prompt))], abs=1e-5)


def test_more_alternatives_than_the_vocabulary_gives_them_all():
    """logprobs / prompt_logprobs of 20 on a 6-token vocabulary list the 6 (a step that failed
    here used to fail every request in it)."""
    target = TableModel(6, seed=3)
    config = DecodeConfig(3, SamplingParams(temperature=0), prompt_logprobs=20, logprobs=20)
    result = run(target, None, [1, 2, 3], config)
    assert [len(e.top) for e in result.prompt_logprobs[1:]] == [6, 6]
    assert [len(e.top) for e in result.logprobs] == [6, 6, 6]
