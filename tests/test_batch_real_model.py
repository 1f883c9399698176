"""The default pair decoding a batch, for real (fp32, greedy): each row equals its prompt alone.

Needs the [models] extra (see test_real_model.py); loads the 1.5B target and the 0.5B draft."""

import pytest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.data import humaneval_prompts

pytestmark = pytest.mark.real_model


def test_default_pair_batch_of_two_humaneval_prompts_equals_each_alone():
    decoder = SpeculativeDecoder(dtype="float32", num_speculative_tokens=4)
    prompts = [problem["prompt"] for problem in humaneval_prompts(2)]
    greedy = SamplingParams(temperature=0)
    batched = decoder.generate(prompts, max_new_tokens=16, sampling=greedy, chat=False)
    for prompt, got in zip(prompts, batched):
        alone = decoder.generate(prompt, max_new_tokens=16, sampling=greedy, chat=False)
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.stats.num_accepted > 0 and got.stats.num_target_calls < 16
