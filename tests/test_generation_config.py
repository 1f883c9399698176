"""The target's own generation_config defaults: the penalties we support are applied
exactly (as transformers' generate applies them), the rest are named in one warning, and
use_generation_config=False ignores them."""

import warnings

import pytest
import torch

from specdecode import SamplingParams, SpeculativeDecoder

from helpers import tiny_llama


@pytest.fixture(scope="module")
def penalized_dirs(tmp_path_factory, char_tokenizer):
    root = tmp_path_factory.mktemp("gen_config")
    dirs = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        model = tiny_llama(seed, layers=layers, vocab=len(char_tokenizer))
        if name == "target":
            model.generation_config.repetition_penalty = 1.5
            model.generation_config.no_repeat_ngram_size = 3
            model.generation_config.do_sample = True
            model.generation_config.temperature = 0.7
        model.save_pretrained(root / name)
        char_tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def test_generation_config_penalties_apply_exactly_and_the_rest_is_named_once(penalized_dirs, char_tokenizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = SpeculativeDecoder(penalized_dirs["target"], penalized_dirs["draft"], num_speculative_tokens=3,
                                     dtype="float32", guard=False)
    messages = [str(w.message) for w in caught if "generation_config" in str(w.message)]
    assert len(messages) == 1 and "do_sample=True" in messages[0] and "temperature=0.7" in messages[0]
    assert decoder.requests.defaults == {"repetition_penalty": 1.5, "no_repeat_ngram_size": 3}
    greedy = SamplingParams(temperature=0)
    result = decoder.generate("abcab", max_new_tokens=30, sampling=greedy, chat=False)
    model = decoder.target.backend.model
    ids = char_tokenizer.encode("abcab", add_special_tokens=False)
    # transformers applies the same generation_config (greedy: do_sample=False overrides its sampling)
    out = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    eos = char_tokenizer.eos_token_id
    if eos in expected:
        expected = expected[:expected.index(eos) + 1]
    assert result.token_ids == expected
    assert result.stats.num_drafted > 0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ignoring = SpeculativeDecoder(penalized_dirs["target"], None, dtype="float32", use_generation_config=False)
    assert ignoring.requests.defaults == {}
    plain = ignoring.generate("abcab", max_new_tokens=30, sampling=greedy, chat=False)
    raw = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, pad_token_id=0,
                         repetition_penalty=1.0, no_repeat_ngram_size=0)[0, len(ids):].tolist()
    assert plain.token_ids == raw[:len(plain.token_ids)] and plain.token_ids != result.token_ids
    # an explicit request value wins over the model's
    explicit = decoder.generate("abcab", max_new_tokens=30, sampling=SamplingParams(temperature=0,
                                                                                     repetition_penalty=1.2), chat=False)
    assert explicit.token_ids != result.token_ids
