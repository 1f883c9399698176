"""dtype="gguf" on specdecode's own kernels (models/kquant.py): a GGUF file's Q4_K/Q6_K blocks read
as stored. The tiny file here is a random Qwen2 (hidden 256) quantized to Q4_K_M by llama.cpp's own
quantizer, so it holds both block types as a real file does. Its logits are close to the
dequantized model's and to llama.cpp's on the same file, and bit for bit the same for a token read
alone, in a k-token verify or in a prompt read: greedy speculative output equals plain greedy output.
A negative control (a product that rounds several rows differently) fails the same check."""

import pytest
import torch

from helpers import at_once, stepwise
from specdecode import native
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM, llamacpp
from specdecode.models.gguf_convert import converted_gguf
from specdecode.models.tiny_gguf import tiny_qwen2, tiny_vocabulary, write_gguf
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams

pytestmark = [pytest.mark.skipif(not native.available(), reason="no C++ compiler for specdecode.native"),
              pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python (its quantizer) is not installed")]

PROMPT = [5, 17, 33, 2, 71, 40, 8, 11, 60, 3]
TOKENS = [9, 44, 2, 2, 90, 13, 7, 61, 5]


@pytest.fixture(scope="module")
def files(tmp_path_factory, module_cache):
    """{"f32": the tiny model as an F32 GGUF, "q4_k_m": llama.cpp's Q4_K_M of it, "model": the float32
    transformers model it was written from}."""
    root = tmp_path_factory.mktemp("kquant")
    tokens, merges = tiny_vocabulary(320)
    model = tiny_qwen2(3, len(tokens), hidden=256)
    write_gguf(model, tokens, merges, root / "tiny-f32.gguf")
    return {"f32": root / "tiny-f32.gguf", "q4_k_m": converted_gguf(root / "tiny-f32.gguf", "q4_k_m"),
            "model": model}


def kquant_backend(path):
    from specdecode.models.kquant import kquant_model

    backend = kquant_model(path)
    assert backend.batch_invariant
    return backend


def test_the_file_holds_both_block_types_and_the_f32_file_is_refused_with_the_reason(files):
    from specdecode.models.gguf_files import TensorTable
    from specdecode.models.kquant import describe, kquant_model, unsupported

    table = TensorTable(files["q4_k_m"])
    assert {table.type_name(n) for n, (_, shape, _) in table.tensors.items() if len(shape) > 1} == {"Q4_K", "Q6_K"}
    assert unsupported(files["q4_k_m"]) is None and describe(files["q4_k_m"]) == "qwen2 Q4_K+Q6_K"
    assert "F32" in unsupported(files["f32"])
    with pytest.raises(ValueError, match="F32"):
        kquant_model(files["f32"])


def test_logits_close_to_the_dequantized_model_and_to_llama_cpp(files):
    from transformers import AutoModelForCausalLM

    path = files["q4_k_m"]
    ours = kquant_backend(path)
    ours.add_row()
    logits = ours.forward([PROMPT], len(PROMPT))[0].double()
    dequantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        reference = dequantized(torch.tensor([PROMPT])).logits[0].double()
    # the int8 activations and bfloat16 hidden states against the float32 forward of the same weights
    bound = 0.05 * float(reference.abs().max())
    assert float((logits - reference).abs().max()) < bound
    # the same next token, or one the dequantized model ranks within that bound of its own (a near-tie)
    picked = reference.gather(-1, logits.argmax(-1, keepdim=True))[:, 0]
    assert bool((picked >= reference.max(-1).values - bound).all())
    assert int((logits.argmax(-1) == reference.argmax(-1)).sum()) >= 8
    llama = llamacpp.LlamaCppLM(path, max_rows=1)
    llama.add_row()
    theirs = llama.forward([PROMPT], len(PROMPT))[0].double()
    llama.close()
    assert float((logits - theirs).abs().max()) < 0.05 * float(theirs.abs().max())


def test_a_verify_rounds_exactly_as_one_token_steps(files):
    backend = kquant_backend(files["q4_k_m"])
    steps = stepwise(backend, PROMPT, TOKENS)
    for k in (2, 5, 9):
        assert torch.equal(at_once(backend, PROMPT, TOKENS[:k]), steps[:k]), f"a {k}-token verify rounds differently"
    backend.reset()  # the whole prompt read with the tokens, in one call, and scored
    backend.add_row()
    assert torch.equal(backend.forward([PROMPT + TOKENS[:-1]], len(TOKENS))[0], steps)
    assert torch.equal(next(backend.score(PROMPT + TOKENS[:-1]))[len(PROMPT) - 1:], steps)


def test_the_check_fails_a_kernel_that_rounds_several_rows_differently(files, monkeypatch):
    """Negative control: a product whose calls of several rows quantize the activations per call
    (one scale for all rows, another rounding) breaks the verify check above."""
    backend = kquant_backend(files["q4_k_m"])
    steps = stepwise(backend, PROMPT, TOKENS)
    original = native.linear_kq

    def row_count_dependent(x, weights, bias=None, out_float32=False):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return original(x, weights, bias, out_float32)
        scale = rows.float().abs().max() / rows.float().abs().amax(-1, keepdim=True)  # the call's largest row
        out = original((rows.float() / scale).bfloat16(), weights, bias, True) * scale
        out = out.view(*x.shape[:-1], -1)
        return out if out_float32 else out.bfloat16()

    monkeypatch.setattr(native, "linear_kq", row_count_dependent)
    assert not torch.equal(at_once(backend, PROMPT, TOKENS), steps)


def test_greedy_speculative_equals_plain_greedy(files):
    """5 prompts × 60 greedy tokens, γ = 6, the draft the unquantized model on torch (mostly right,
    parting where quantization moved a token): every answer equals plain decoding's."""
    target = kquant_backend(files["q4_k_m"])
    draft = HFCausalLM(files["model"], lean=True)
    greedy = SamplingParams(temperature=0)
    rejected = 0
    for shift in range(5):
        prompt = [(7 * t + 13 * shift) % 300 for t in PROMPT]
        plain = run(target, None, prompt, DecodeConfig(max_new_tokens=60, sampling=greedy, num_speculative_tokens=0))
        spec = run(target, DraftModelProposer(draft), prompt,
                   DecodeConfig(max_new_tokens=60, sampling=greedy, num_speculative_tokens=6))
        assert spec.stats.batch_invariant and spec.stats.num_target_calls < 40
        assert spec.token_ids == plain.token_ids
        rejected += spec.stats.num_rejected
    assert rejected > 0  # the draft did part from the target: the verifies did reject


def test_dtype_gguf_runs_the_files_blocks_when_asked_and_names_the_kernel(files):
    from specdecode import SpeculativeDecoder

    greedy = SamplingParams(temperature=0)
    spec = SpeculativeDecoder(str(files["q4_k_m"]), str(files["f32"]), dtype="gguf", batch_invariant=True,
                              quantize_draft="gguf", guard=False, num_speculative_tokens=4)
    report = spec.configuration()
    assert report["target_kernel"] == "gguf-invariant" and report["batch_invariant"] is True
    assert report["dtype"] == "gguf" and report["target_weights"] == "qwen2 Q4_K+Q6_K GGUF"
    plain = SpeculativeDecoder(str(files["q4_k_m"]), None, dtype="gguf", batch_invariant=True, guard=False)
    for prompt in ("def add(a, b):", "The quick brown"):
        a = spec.generate(prompt, chat=False, max_new_tokens=40, sampling=greedy)
        b = plain.generate(prompt, chat=False, max_new_tokens=40, sampling=greedy)
        # (on a target this small the measured choice drafts with free drafts only: they verify too)
        assert a.token_ids == b.token_ids and a.stats.num_drafted > 0
    with pytest.raises(ValueError, match="F32"):
        SpeculativeDecoder(str(files["f32"]), None, dtype="gguf", batch_invariant=True)


def test_auto_times_the_files_blocks_beside_llama_cpp(files):
    from specdecode.config import DecoderConfig
    from specdecode.tune import candidates_of

    config = DecoderConfig(target=str(files["q4_k_m"]), draft=None, dtype="gguf").validate()
    assert candidates_of(config, "none")[0] == ("llama.cpp-gguf", "gguf-invariant")
    off = DecoderConfig(target=str(files["q4_k_m"]), draft=None, dtype="gguf", batch_invariant=False).validate()
    assert candidates_of(off, "none")[0] == ("llama.cpp-gguf",)
    f32 = DecoderConfig(target=str(files["f32"]), draft=None, dtype="gguf").validate()
    assert candidates_of(f32, "none")[0] == ("llama.cpp-gguf",)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantizing_one_tensor_at_a_time_gives_transformers_weights_bit_for_bit(files, dtype):
    """The first run's GGUF → bfloat16 cache (gguf_files.dequantized_model) against transformers'
    own GGUF loader, every parameter and buffer; a file of another architecture is left to it."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.gguf_files import dequantized_model

    path = files["q4_k_m"]
    ours = dequantized_model(path, dtype)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    with torch.inference_mode():
        assert torch.equal(ours(torch.tensor([PROMPT])).logits, theirs(torch.tensor([PROMPT])).logits)


def test_a_file_without_an_output_matrix_is_dequantized_with_the_head_tied(files, tmp_path):
    """No output.weight: the LM head is the token embeddings' own tensor (as transformers ties it),
    never an uninitialized one, and the logits are transformers' own."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.gguf_files import dequantized_model

    tokens, merges = tiny_vocabulary(320)
    write_gguf(files["model"], tokens, merges, tmp_path / "tied.gguf", tied=True)
    ours = dequantized_model(tmp_path / "tied.gguf", torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tied.gguf", dtype=torch.float32)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.inference_mode():
        logits = ours(torch.tensor([PROMPT])).logits
        assert torch.equal(logits, theirs(torch.tensor([PROMPT])).logits)
        # the head is the embedding: the untied model's logits differ
        assert not torch.allclose(logits, files["model"](torch.tensor([PROMPT])).logits, atol=1e-3)
