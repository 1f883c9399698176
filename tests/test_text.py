"""Incremental detokenization and stop strings."""

import pytest

from specdecode.engine.text import IncrementalDetokenizer, StopStrings


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE tokenizer trained on the spot: multi-byte characters split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the cache is warm"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TEXT = "hello wörld — 日本語 🙂 cache  is warm"


def test_incremental_text_equals_full_decode_and_never_shows_broken_utf8(byte_bpe):
    prompt = byte_bpe.encode("say: ")
    ids = byte_bpe.encode(TEXT)
    assert len(ids) > len(TEXT) // 2  # the emoji and CJK characters take several byte tokens
    detok = IncrementalDetokenizer(byte_bpe, prompt)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT
    assert any(p == "" for p in pieces)  # some bytes were held back until their character completed


def test_stop_string_holds_back_a_possible_prefix_then_cuts_before_it():
    stops = StopStrings(["</end>"])
    assert stops.push("abc</") == ("abc", False)
    assert stops.push("e") == ("", False)
    assert stops.push("x") == ("</ex", False)  # not a stop after all: released
    assert stops.push("yz</en") == ("yz", False)
    assert stops.push("d> more") == ("", True)


def test_earliest_of_several_stop_strings_wins():
    stops = StopStrings(["bb", "a"])
    assert stops.push("xxbba") == ("xx", True)
