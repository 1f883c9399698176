"""Real transformers models (tiny, random, float32): greedy speculative decoding equals plain
greedy decoding token for token, and transformers' own generate."""

import pytest
import torch

from specdecode import SamplingParams
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer

from helpers import PROMPT, VOCAB, greedy, single_row_logits, tiny_llama, tiny_mistral


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    # A draft that agrees with the target often but not always: the target plus noise.
    draft = tiny_llama(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.005 * torch.randn_like(param))
    return target, draft


@pytest.mark.parametrize("k,confidence", [(1, 0.0), (3, 0.0), (8, 0.0), (8, 0.3)])
def test_speculative_greedy_equals_plain_greedy_token_for_token(pair, k, confidence):
    target, draft = pair
    plain = run(HFCausalLM(target), None, PROMPT, greedy(64))
    spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(draft), confidence), PROMPT,
               DecodeConfig(max_new_tokens=64, sampling=SamplingParams(temperature=0), num_speculative_tokens=k))
    assert spec.token_ids == plain.token_ids
    # both paths were exercised: some drafts accepted, some rejected
    assert 0 < spec.stats.num_accepted < spec.stats.num_drafted
    assert spec.stats.num_target_calls < 64


def test_plain_greedy_equals_transformers_generate(pair):
    target, _ = pair
    plain = run(HFCausalLM(target), None, PROMPT, greedy(32))
    with torch.no_grad():
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    assert plain.token_ids == reference[0, len(PROMPT):].tolist()


def test_lookup_with_vocab_limited_draft_keeps_greedy_output(pair):
    target, draft = pair
    plain = run(HFCausalLM(target), None, PROMPT, greedy(64))
    proposer = FallbackProposer(PromptLookupProposer(VOCAB), DraftModelProposer(HFCausalLM(draft, vocab_limit=64), 0.3))
    spec = run(HFCausalLM(target), proposer, PROMPT,
               DecodeConfig(max_new_tokens=64, sampling=SamplingParams(temperature=0), num_speculative_tokens=6))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_lookup_steps > 0 and spec.stats.num_accepted > 0


def test_vocab_limited_backend_returns_the_first_rows_of_the_full_logits(pair):
    target, _ = pair
    full = single_row_logits(HFCausalLM(target), PROMPT, 3)
    limited = single_row_logits(HFCausalLM(target, vocab_limit=40), PROMPT, 3)
    assert limited.shape == (3, 40)
    assert torch.allclose(limited, full[:, :40], atol=1e-5)


def test_unrelated_draft_still_gives_target_greedy_output(pair):
    target, _ = pair
    other = tiny_llama(123, layers=1)
    plain = run(HFCausalLM(target), None, PROMPT, greedy(40))
    spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(other)), PROMPT,
               DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0), num_speculative_tokens=4))
    assert spec.token_ids == plain.token_ids


def test_rollback_leaves_the_kv_cache_exactly_at_the_committed_length(pair):
    target, draft = pair
    backend = HFCausalLM(target)
    backend.add_row()
    backend.forward([PROMPT], 1)
    logits_full = backend.forward([[1, 2, 3, 4]], 4)[0]
    backend.truncate([len(PROMPT) + 1])
    assert backend.cache.get_seq_length() == len(PROMPT) + 1 and backend.lengths == [len(PROMPT) + 1]
    assert backend.num_slots == len(PROMPT) + 1  # one row's rollback crops: no dead slots remain
    again = backend.forward([[2, 9]], 2)[0]
    assert torch.allclose(again[0], logits_full[1], atol=1e-5)


def test_sliding_window_model_rolls_back_past_its_window():
    target, draft = tiny_mistral(0, 2), tiny_mistral(1, 1)
    plain = run(HFCausalLM(target), None, [1, 2, 3], greedy(40))
    spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(draft)), [1, 2, 3],
               DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0), num_speculative_tokens=3))
    assert spec.token_ids == plain.token_ids


def test_tiny_temperature_gives_a_distribution_not_nan(pair):
    target, draft = pair
    spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(draft)), PROMPT,
               DecodeConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1e-40, seed=0),
                            num_speculative_tokens=3))
    assert spec.token_ids == run(HFCausalLM(target), None, PROMPT, greedy(16)).token_ids
