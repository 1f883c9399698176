"""Per-token logprobs (issue 12): the target's raw log-softmax at each returned token's position,
the same with and without speculation, and equal to a plain transformers forward."""

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM
from specdecode.proposers import DraftModelProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import PROMPT, decode, tiny_llama


@pytest.fixture(scope="module")
def llamas():
    return tiny_llama(0, layers=2), tiny_llama(1, layers=1)


def _config(sampling, k, top=5, **extra):
    return DecodeConfig(max_new_tokens=30, sampling=sampling, num_speculative_tokens=k, logprobs=top, **extra)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, seed=4),
                                      SamplingParams(temperature=0, repetition_penalty=1.5)],
                         ids=["greedy", "sampled-t0.7", "greedy-penalized"])
def test_logprobs_equal_a_plain_transformers_forward_with_and_without_speculation(llamas, sampling):
    target_model, draft_model = llamas
    spec = run(HFCausalLM(target_model), PromptLookupProposer(96, fallback=DraftModelProposer(HFCausalLM(draft_model))),
               PROMPT, _config(sampling, 4))
    assert spec.stats.num_accepted > 0
    with torch.no_grad():
        logits = target_model(torch.tensor([PROMPT + spec.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1)  # raw: no temperature, no penalty
    assert len(spec.logprobs) == len(spec.token_ids)
    for i, (entry, token) in enumerate(zip(spec.logprobs, spec.token_ids)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(reference[i, token])) <= 1e-5, i
        values, ids = reference[i].topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert max(abs(lp - float(v)) for (_, lp), v in zip(entry.top, values)) <= 1e-5
    if sampling.greedy and sampling.repetition_penalty == 1.0:
        plain = run(HFCausalLM(target_model), None, PROMPT, _config(sampling, 0))
        assert plain.token_ids == spec.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(spec.logprobs, plain.logprobs)) <= 1e-5


def test_logprobs_zero_gives_no_alternatives_and_none_gives_none(llamas):
    target_model, _ = llamas
    result = run(HFCausalLM(target_model), None, PROMPT, _config(SamplingParams(temperature=0), 0, top=0))
    assert all(entry.top == [] for entry in result.logprobs)
    assert run(HFCausalLM(target_model), None, PROMPT, _config(SamplingParams(temperature=0), 0, top=None)).logprobs is None


def test_stream_events_carry_the_logprobs(llamas):
    target_model, draft_model = llamas
    stream = decode(HFCausalLM(target_model), DraftModelProposer(HFCausalLM(draft_model)), PROMPT,
                    _config(SamplingParams(temperature=0), 3, top=2))
    events = []
    while True:
        try:
            events.append(next(stream))
        except StopIteration as stop:
            result = stop.value
            break
    assert [e.logprob for e in events] == result.logprobs
    record = result.to_dict()
    assert record["logprobs"][0]["token_id"] == result.token_ids[0] and len(record["logprobs"][0]["top"]) == 2
