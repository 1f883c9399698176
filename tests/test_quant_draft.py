"""Preparing a draft for the int8/int4 kernels: dtypes they refuse, and the on-disk cache of a
quantized zoo draft (it must give exactly the logits of a freshly quantized one)."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.models import quant, quant_cache, zoo
from specdecode.models.quant import prepare_draft
from specdecode.models.quant_cache import prepare_draft_cached


def tiny_llama(seed=0, vocab=96, dtype=torch.float32):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_float64_draft_is_refused_before_quantizing_naming_the_dtype(bits):
    draft = tiny_llama(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"torch\.float64: .*float32, bfloat16 or float16.*quantize_draft='none'"):
        prepare_draft(draft, bits)
    assert isinstance(draft.lm_head, torch.nn.Linear)  # refused before any layer was replaced


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_dtypes_are_accepted(dtype):
    draft = prepare_draft(tiny_llama(dtype=dtype), 4)
    assert draft(torch.tensor([[5, 17, 33]])).logits.dtype == dtype


def test_the_decoder_refuses_a_float64_draft_to_quantize_at_construction(char_tokenizer):
    target = tiny_llama(0, vocab=len(char_tokenizer))
    draft = tiny_llama(1, vocab=len(char_tokenizer), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"draft whose linear layers are torch\.float64"):
        SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, quantize_draft="int4", guard=False)
    assert SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, guard=False).draft is not None  # unquantized


def test_a_float64_pair_by_path_decodes_with_the_default_quantization_and_says_why_not(model_dirs):
    # the default picks what works (no int kernels for float64) and says so; greedy equals plain
    with pytest.warns(UserWarning, match="float64 draft keeps its weights"):
        decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float64", guard=False)
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float64")
    greedy = SamplingParams(temperature=0)
    assert decoder.generate("abc", max_new_tokens=12, sampling=greedy, chat=False).token_ids == \
        plain.generate("abc", max_new_tokens=12, sampling=greedy, chat=False).token_ids


@pytest.fixture
def tiny_zoo(tmp_path, monkeypatch):
    """A zoo entry "tiny" (no parts needed: its models are built in the tests) and an empty cache."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(zoo.ZOO, "tiny", zoo.ZooModel("tiny", "tinypart{}", 1, "1.0", 1, "ab" * 32, "tiny-part{}"))
    monkeypatch.setattr(zoo, "check_installed", lambda name: None)  # nothing to install: built in the tests
    return tmp_path / "cache"


def logits(model, rows):
    """[1, rows, V] logits; more than a layer's dequantize_above_rows take the dequantized GEMM."""
    with torch.no_grad():
        return model(torch.arange(rows)[None] * 7 % 90 + 3).logits


def cached_files(cache):
    return sorted(p.name for p in (cache / "safetensors").iterdir())


@pytest.mark.parametrize("bits, dtype", [(4, torch.bfloat16), (8, torch.bfloat16), (4, torch.float32)])
def test_a_cached_quantized_draft_gives_exactly_the_logits_of_a_fresh_one(tiny_zoo, monkeypatch, bits, dtype):
    first, second = [], []
    fresh = prepare_draft_cached(tiny_llama(dtype=dtype), bits, "tiny", first.append)
    [name] = cached_files(tiny_zoo)  # one file, no temporary left behind
    path = tiny_zoo / "safetensors" / name
    assert name.startswith(f"tiny-{str(dtype)[6:]}-int{bits}-") and name.endswith(".safetensors")
    assert first == [f"quantizing the draft to int{bits} (once; cached in {path})"]

    def no_quantizing(*args):
        raise AssertionError("a cached draft must not be quantized again")

    with monkeypatch.context() as patch:
        patch.setattr(quant, "quantize", no_quantizing)
        cached = prepare_draft_cached(tiny_llama(dtype=dtype), bits, "tiny", second.append)
    assert second == [f"loading the int{bits} draft from {path}"]
    assert [type(m) for m in cached.modules()] == [type(m) for m in fresh.modules()]
    in_memory = prepare_draft(tiny_llama(dtype=dtype), bits)
    for rows in (3, 200):  # the integer kernels, and the dequantized GEMM (above 160 rows in bfloat16)
        assert torch.equal(logits(cached, rows), logits(fresh, rows))
        assert torch.equal(logits(cached, rows), logits(in_memory, rows))
    assert cached.config._attn_implementation == "eager"


def test_the_cache_key_follows_source_weights_dtype_kind_group_size_code_and_kernel(tiny_zoo, monkeypatch):
    model = tiny_llama(dtype=torch.bfloat16)
    base = quant_cache.cache_path(model, "tiny", 4)
    assert base.parent == zoo.weights_cache("tiny", torch.bfloat16).parent  # beside the float weights
    assert quant_cache.cache_path(tiny_llama(dtype=torch.bfloat16), "tiny", 4) == base
    keys = {base, quant_cache.cache_path(model, "tiny", 8), quant_cache.cache_path(tiny_llama(), "tiny", 4)}
    for owner, name, value in [(quant, "DEFAULT_GROUP_SIZE", 64),
                               (quant_cache, "FORMAT_VERSION", quant_cache.FORMAT_VERSION + 1),
                               (quant_cache, "_code_version", lambda: "edited quant.py"),
                               (quant, "kernel_layout", lambda: "torch 9.0, AVX2"),  # another int4 packing
                               (zoo, "ZOO", {"tiny": dataclasses.replace(zoo.ZOO["tiny"], sha256="cd" * 32)})]:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            keys.add(quant_cache.cache_path(model, "tiny", 4))
    float_weights = zoo.weights_cache("tiny", torch.bfloat16)
    float_weights.mkdir(parents=True)
    (float_weights / "model.safetensors").write_bytes(b"rebuilt")  # the float weights were cached again
    keys.add(quant_cache.cache_path(model, "tiny", 4))
    assert len(keys) == 9


def test_an_unreadable_or_mismatched_cache_file_is_replaced_by_a_fresh_quantization(tiny_zoo):
    path = quant_cache.cache_path(tiny_llama(), "tiny", 4)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    messages = []
    model = prepare_draft_cached(tiny_llama(), 4, "tiny", messages.append)
    assert messages[0] == f"loading the int4 draft from {path}"
    assert messages[1].startswith(f"warning: cannot use {path} (") and messages[1].endswith("); quantizing again")
    assert messages[2:] == [f"quantizing the draft to int4 (once; cached in {path})"]
    assert torch.equal(logits(model, 3), logits(prepare_draft(tiny_llama(), 4), 3))
    # a file that reads but belongs to other weights (another vocabulary) is refused the same way
    prepare_draft_cached(tiny_llama(vocab=48), 4, "tiny")  # same key: same zoo entry and dtype
    messages = []
    model = prepare_draft_cached(tiny_llama(), 4, "tiny", messages.append)
    assert "does not fit the model" in messages[1] and len(messages) == 3
    assert torch.equal(logits(model, 3), logits(prepare_draft(tiny_llama(), 4), 3))
    assert cached_files(tiny_zoo) == [path.name]


def test_an_older_cache_file_of_the_same_draft_is_removed(tiny_zoo, monkeypatch):
    prepare_draft_cached(tiny_llama(), 4, "tiny")
    prepare_draft_cached(tiny_llama(), 8, "tiny")
    [int4, int8] = cached_files(tiny_zoo)
    monkeypatch.setattr(quant_cache, "FORMAT_VERSION", quant_cache.FORMAT_VERSION + 1)
    prepare_draft_cached(tiny_llama(), 4, "tiny")
    assert int8 in cached_files(tiny_zoo) and int4 not in cached_files(tiny_zoo)
    assert len(cached_files(tiny_zoo)) == 2


def test_a_cache_that_cannot_be_written_only_costs_speed(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(blocker))
    monkeypatch.setitem(zoo.ZOO, "tiny", zoo.ZooModel("tiny", "tinypart{}", 1, "1.0", 1, "ab" * 32, "tiny-part{}"))
    messages = []
    model = prepare_draft_cached(tiny_llama(), 4, "tiny", messages.append)
    assert messages[0].startswith("quantizing the draft to int4 (once; cached in")
    assert messages[1].startswith("warning: could not cache the int4 draft in")
    assert torch.equal(logits(model, 3), logits(prepare_draft(tiny_llama(), 4), 3))


@pytest.mark.parametrize("source", [None, "some/local/path"])
def test_a_draft_not_loaded_from_the_zoo_is_quantized_in_memory(tiny_zoo, source):
    messages = []
    model = prepare_draft_cached(tiny_llama(), 4, source, messages.append)
    assert messages == ["quantizing the draft to int4"]
    assert not tiny_zoo.exists()
    assert torch.equal(logits(model, 3), logits(prepare_draft(tiny_llama(), 4), 3))


def test_the_decoder_quantizes_a_zoo_draft_once_then_loads_it(tiny_zoo, monkeypatch, char_tokenizer):
    vocab = len(char_tokenizer)
    monkeypatch.setattr(zoo, "load_zoo_model", lambda name, dtype, progress=None: (
        tiny_llama(1, vocab=vocab, dtype=dtype), char_tokenizer))
    target = tiny_llama(0, vocab=vocab)
    runs = []
    for _ in range(2):
        messages = []
        decoder = SpeculativeDecoder(target, "tiny", tokenizer=char_tokenizer, dtype="float32", guard=False,
                                     progress=messages.append)
        result = decoder.generate("abcab", max_new_tokens=12, sampling=SamplingParams(temperature=0))
        runs.append((messages, result.token_ids, result.stats.num_accepted))
    path = quant_cache.cache_path(tiny_llama(1, vocab=vocab), "tiny", 4)
    assert f"quantizing the draft to int4 (once; cached in {path})" in runs[0][0]
    assert f"loading the int4 draft from {path}" in runs[1][0]
    assert runs[0][1:] == runs[1][1:]
