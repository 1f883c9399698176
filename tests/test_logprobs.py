"""Per-token logprobs: the target's raw log-softmax at each returned token's position,
the same with and without speculation, and equal to a plain transformers forward."""

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import PROMPT, decode, drain, tiny_llama


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
    proposer = FallbackProposer(PromptLookupProposer(96), DraftModelProposer(HFCausalLM(draft_model)))
    spec = run(HFCausalLM(target_model), proposer, PROMPT, _config(sampling, 4))
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
    events, result = drain(stream)
    assert [e.logprob for e in events] == result.logprobs
    record = result.to_dict()
    assert record["logprobs"][0]["token_id"] == result.token_ids[0] and len(record["logprobs"][0]["top"]) == 2


# --- logprobs after a stop string (the library gives what the wire formats list) --------------------

SCRIPT_WORDS = [" landsc", "旨"]  # a 7-character token, then a multi-byte character, one token each


@pytest.fixture(scope="module")
def script_dirs(tmp_path_factory):
    """A tiny target and draft whose tokenizer has ' landsc' and '旨' as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<bos>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(SCRIPT_WORDS + list("abc"))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>", bos_token="<bos>")
    root, dirs = tmp_path_factory.mktemp("script"), {}
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_llama(seed, layers=1, vocab=len(tokenizer)).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def scripted(first: int, then: int):
    """A logits processor that makes greedy decoding emit `first`, then `then` for ever."""
    def processor(input_ids, scores):
        forced = first if input_ids.shape[1] == 3 else then  # the prompt "abc" is 3 tokens
        scores = torch.full_like(scores, -1e9)
        scores[0, forced] = 0.0
        return scores
    return processor


@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("stop, text", [("旨旨", " landsc"), ("旨", " landsc"), ("c旨", " lands")])
def test_the_results_logprobs_cover_exactly_the_text_a_stop_string_leaves(script_dirs, with_draft, stop, text):
    """A stop string that starts at a token boundary ends the listed tokens before it; one that
    starts inside a token lists that token (text_offset never past the text), as the server does."""
    from specdecode import SpeculativeDecoder
    from specdecode.frontend import responses

    decoder = SpeculativeDecoder(script_dirs["target"], script_dirs["draft"] if with_draft else None,
                                 dtype="float32", guard=False, num_speculative_tokens=3)
    landsc, mark = (decoder.tokenizer.convert_tokens_to_ids(w) for w in SCRIPT_WORDS)
    kw = dict(max_new_tokens=8, sampling=SamplingParams(temperature=0), chat=False, logprobs=2, stop=stop,
              logits_processors=[scripted(landsc, mark)])
    full = decoder.generate("abc", **kw)
    stream = decoder.generate("abc", stream=True, **kw)
    events = list(stream)
    for result in (full, stream.result):
        assert result.text == text and result.finish_reason == "stop"
        assert result.token_ids[:2] == [landsc, mark]        # every generated token is counted
        assert [e.token_id for e in result.logprobs] == [landsc] and result.text_offsets == [0]
        assert result.num_returned_tokens == 1 and result.to_dict()["logprobs"] == [result.logprobs[0].to_dict()]
        body = responses.full_response(responses.ResponseIds(False, "m"), [result], 3, decoder.tokenizer)
        assert body["choices"][0]["logprobs"]["tokens"] == [" landsc"]
        assert body["choices"][0]["logprobs"]["text_offset"] == [0]
    # the stream lists every token and all the text; a token past the cut has no logprob, as in the result
    assert [e.token_id for e in events] == stream.result.token_ids
    assert "".join(e.text for e in events) == stream.result.text
    assert [e.logprob for e in events if e.logprob is not None] == stream.result.logprobs
