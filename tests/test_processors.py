"""Penalties and logits processors (docs/exactness.md rule 9): the same as transformers' and
OpenAI's definitions, applied to p and q at every position with the prefix up to it, exact under
speculation, and nothing from a rejected draft leaks."""

import itertools
from collections import Counter

import pytest
import torch
from transformers import (LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor)

from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM, TableModel
from specdecode.processors import LogitsPipeline, Penalties, ProcessorList, build_pipeline
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams, adjust

from helpers import PROMPT, chi2_pvalue, tiny_llama


def openai_penalties(logits, prefix, prompt_len, presence, frequency):
    counts = Counter(prefix[prompt_len:])
    out = logits.clone()
    for token, count in counts.items():
        out[token] -= frequency * count + presence
    return out


def test_repetition_penalty_equals_transformers_processor():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator) * 3
    committed, drafts = [4, 9, 4, 30, 7], [11, 9]
    penalties = Penalties(1.7, 0.0, 0.0, prompt_len=2, vocab_size=50)
    got = penalties(committed, drafts, logits.clone())
    reference = RepetitionPenaltyLogitsProcessor(1.7)
    for i in range(3):
        ids = torch.tensor([committed + drafts[:i]])
        assert torch.allclose(got[i], reference(ids, logits[i:i + 1].clone())[0])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    committed, drafts = [5, 6, 5, 8, 8, 8], [5, 2]   # the prompt is [5, 6]
    got = Penalties(1.0, 0.5, 0.25, prompt_len=2, vocab_size=40)(committed, drafts, logits.clone())
    for i in range(3):
        expected = openai_penalties(logits[i], committed + drafts[:i], 2, 0.5, 0.25)
        assert torch.allclose(got[i], expected), i
    assert got[0, 6] == logits[0, 6]  # in the prompt only: no presence penalty


def test_pipeline_rows_equal_one_position_at_a_time_and_forget_drafts():
    # row i of a k+1 call, the draft side's one-position calls (start = i) and a fresh pipeline over
    # committed + drafts[:i] agree; calling with drafts leaves no trace in the next call
    sampling = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.3)
    ban_last = lambda ids, scores: scores.index_fill(1, ids[0, -1:], float("-inf"))  # noqa: E731
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    committed, drafts = [1, 2, 3, 4, 3], [3, 7, 3]
    pipeline = build_pipeline(sampling, 2, 30, [ban_last])
    before = pipeline(committed, [], logits[:1])
    batched = pipeline(committed, drafts, logits)
    for i in range(4):
        one = pipeline(committed, drafts, logits[i:i + 1], start=i)
        fresh = build_pipeline(sampling, 2, 30, [ban_last])(committed + drafts[:i], [], logits[i:i + 1])
        assert torch.equal(batched[i], one[0]) and torch.equal(one, fresh), i
    assert torch.equal(pipeline(committed, [], logits[:1]), before)
    assert build_pipeline(SamplingParams(), 2, 30) is None  # nothing to do: the fast path


def test_pipeline_pads_a_narrower_draft_vocabulary_with_minus_infinity():
    pipeline = LogitsPipeline([Penalties(2.0, 0, 0, 1, 10)], vocab_size=10)
    out = pipeline([1, 2], [], torch.zeros(1, 6))
    assert out.shape == (1, 10) and torch.isinf(out[0, 6:]).all() and torch.isfinite(out[0, :6]).all()


# --- exact under speculation: greedy equality with plain decoding and with transformers ----------

def _greedy(n, k, **sampling):
    return DecodeConfig(max_new_tokens=n, sampling=SamplingParams(temperature=0, **sampling), num_speculative_tokens=k)


@pytest.fixture(scope="module")
def llamas():
    return tiny_llama(0, layers=2), tiny_llama(1, layers=1)


def _reference_greedy(model, prompt, n, transform):
    """Plain greedy with the full prefix every step (no cache): transform(prefix, logits [V])."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            tokens.append(int(transform(tokens, logits).argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8), dict(presence_penalty=1.5),
                                       dict(frequency_penalty=0.9, presence_penalty=-0.5)],
                         ids=["repetition", "presence", "frequency+presence"])
def test_penalized_greedy_speculative_equals_plain_and_reference(llamas, penalties):
    target_model, draft_model = llamas
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    spec = run(target, DraftModelProposer(draft), PROMPT, _greedy(40, 4, **penalties))
    plain = run(target, None, PROMPT, _greedy(40, 0, **penalties))
    rp = penalties.get("repetition_penalty", 1.0)

    def transform(prefix, logits):
        if rp != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([prefix]), logits[None])[0]
        return openai_penalties(logits, prefix, len(PROMPT), penalties.get("presence_penalty", 0.0),
                                penalties.get("frequency_penalty", 0.0))

    assert spec.token_ids == plain.token_ids == _reference_greedy(target_model, PROMPT, 40, transform)
    unpenalized = run(target, None, PROMPT, _greedy(40, 0))
    assert unpenalized.token_ids != plain.token_ids  # the penalty does change the output
    assert spec.stats.num_drafted > 0 and spec.stats.num_accepted < spec.stats.num_drafted  # rejections happened


def test_repetition_penalty_equals_transformers_generate(llamas):
    target_model, draft_model = llamas
    spec = run(HFCausalLM(target_model), DraftModelProposer(HFCausalLM(draft_model)), PROMPT,
               _greedy(30, 3, repetition_penalty=1.5))
    out = target_model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, repetition_penalty=1.5,
                                pad_token_id=0)
    assert spec.token_ids == out[0, len(PROMPT):].tolist()


def test_logits_processors_speculative_equals_transformers_generate(llamas):
    target_model, draft_model = llamas
    ban_last = lambda ids, scores: scores.index_fill(1, ids[0, -1:], float("-inf"))  # noqa: E731
    procs = (NoRepeatNGramLogitsProcessor(2), ban_last)
    config = DecodeConfig(max_new_tokens=30, sampling=SamplingParams(temperature=0), num_speculative_tokens=3,
                          logits_processors=procs)
    spec = run(HFCausalLM(target_model), DraftModelProposer(HFCausalLM(draft_model)), PROMPT, config)
    out = target_model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, pad_token_id=0,
                                logits_processor=LogitsProcessorList(procs))
    assert spec.token_ids == out[0, len(PROMPT):].tolist()
    assert spec.stats.num_drafted > spec.stats.num_accepted > 0


# --- no leak from rejected drafts --------------------------------------------------------------------

def _leaky_call(self, committed, drafts, logits, start=0):
    # what a leaking implementation does: the drafts it saw stay counted, accepted or not
    self._sync(list(committed) + list(drafts[:start + logits.shape[0] - 1]))
    return _true_call(self, committed, drafts, logits, start)


_true_call = Penalties.__call__


def test_a_rejected_draft_never_changes_a_later_penalty(monkeypatch):
    target, draft = TableModel(8, order=2, seed=3), TableModel(8, order=2, seed=4)
    config = _greedy(40, 4, frequency_penalty=2.0, presence_penalty=1.0)
    plain = run(target, None, [1, 2], config).token_ids
    spec = run(target, DraftModelProposer(draft), [1, 2], config)
    assert spec.token_ids == plain
    assert spec.stats.num_accepted < spec.stats.num_drafted  # drafts were rejected
    # the test has power: counting drafts that were rejected changes the output
    monkeypatch.setattr(Penalties, "__call__", _leaky_call)
    assert run(target, DraftModelProposer(draft), [1, 2], config).token_ids != plain


# --- in distribution: chi-square at T = 1 with table models --------------------------------------

def _penalized_sequence_probs(target, prompt, length, sampling, procs=()):
    """P(s) = Π softmax(transformed logits) by the definitions (transformers' / OpenAI's), over all sequences."""
    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob = 1.0
        for i in range(length):
            prefix = prompt + list(seq[:i])
            logits = target.logits_for(prefix).clone()
            if sampling.repetition_penalty != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(
                    torch.tensor([prefix]), logits[None])[0]
            logits = openai_penalties(logits, prefix, len(prompt), sampling.presence_penalty, sampling.frequency_penalty)
            for proc in procs:
                logits = proc(torch.tensor([prefix]), logits[None])[0]
            prob *= float(adjust(logits, sampling)[seq[i]])
        probs[seq] = prob
    return probs


def _counts(make_proposer, sampling, runs, procs=(), **engine_options):
    target, draft = TableModel(4, order=2, seed=20, sharpness=1.5), TableModel(4, order=2, seed=21, sharpness=1.5)
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=3, sampling=SamplingParams(
            repetition_penalty=sampling.repetition_penalty, presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty, seed=seed), num_speculative_tokens=3,
            logits_processors=tuple(procs))
        counts[tuple(run(target, make_proposer(draft), [1, 2], config, **engine_options).token_ids)] += 1
    expected = _penalized_sequence_probs(target, [1, 2], 3, sampling, procs)
    seqs = sorted(expected)
    return [counts[s] for s in seqs], [expected[s] for s in seqs]


PENALIZED = SamplingParams(repetition_penalty=2.5, presence_penalty=1.5, frequency_penalty=1.0)


@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: FallbackProposer(PromptLookupProposer(4, max_ngram=2, min_ngram=1), DraftModelProposer(d)),
], ids=["draft", "lookup+draft"])
@pytest.mark.slow
def test_penalized_sampling_matches_the_penalized_target_chi_square(make_proposer):
    # 3000 seeded runs (vocab 4, 3 tokens → 64 sequences); significance 1e-3
    observed, probs = _counts(make_proposer, PENALIZED, 3000)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.slow
def test_chi_square_detects_penalties_ignored_on_the_target_side():
    # the test has power: a loop whose p ignores the penalties (q keeps them) is caught
    from specdecode.engine.engine import accept

    observed, probs = _counts(lambda d: DraftModelProposer(d), PENALIZED, 3000,
                              accept_rule=lambda d, q, logits, config, gen, committed, pipeline=None:
                              accept(d, q, logits, config, gen, committed))
    assert chi2_pvalue(observed, probs) < 1e-6


@pytest.mark.slow
def test_processor_sampling_matches_chi_square():
    ban_last = lambda ids, scores: scores.index_fill(1, ids[0, -1:], float("-inf"))  # noqa: E731
    observed, probs = _counts(lambda d: DraftModelProposer(d), SamplingParams(), 3000, procs=[ban_last])
    assert chi2_pvalue(observed, probs) > 1e-3


def test_processor_list_passes_the_whole_prefix():
    seen = []
    ProcessorList([lambda ids, scores: seen.append(ids[0].tolist()) or scores])([1, 2], [3, 4], torch.zeros(3, 5))
    assert seen == [[1, 2], [1, 2, 3], [1, 2, 3, 4]]


def test_rows_with_their_own_pipelines_in_one_batch_equal_each_alone():
    # rule 7 with rule 9: a penalized row, a row with a processor and a plain row share the batch
    from specdecode.engine.driver import run_all
    from specdecode.engine.request import Request

    target, draft = TableModel(8, order=2, seed=5), TableModel(8, order=2, seed=6)
    ban_last = lambda ids, scores: scores.index_fill(1, ids[0, -1:], float("-inf"))  # noqa: E731
    configs = [DecodeConfig(max_new_tokens=20, sampling=SamplingParams(seed=1, repetition_penalty=2.0,
                                                                       frequency_penalty=1.0), num_speculative_tokens=3),
               DecodeConfig(max_new_tokens=20, sampling=SamplingParams(seed=2), num_speculative_tokens=3,
                            logits_processors=(ban_last,)),
               DecodeConfig(max_new_tokens=20, sampling=SamplingParams(seed=3), num_speculative_tokens=3)]
    prompts = [[1, 2], [3, 4, 5], [6]]
    together = run_all(target, DraftModelProposer(draft), [Request(p, c) for p, c in zip(prompts, configs)])
    alone = [run(target, DraftModelProposer(draft), p, c) for p, c in zip(prompts, configs)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(a != b for a, b in zip(together[1].token_ids, together[1].token_ids[1:]))
