"""SpeculativeDecoder and the CLI on tiny local models saved to disk (no network)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdecode import DecoderConfig, SamplingParams, SpeculativeDecoder
from specdecode.cli import main
from specdecode.models.quant import Int4Linear, Int8Linear

from helpers import tiny_llama


@pytest.fixture
def decoder(model_dirs):
    return SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], num_speculative_tokens=3, dtype="float32")


def test_generate_from_local_paths_equals_plain_greedy(decoder, model_dirs):
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    greedy = SamplingParams(temperature=0)
    spec_result = decoder.generate("abc", max_new_tokens=30, sampling=greedy)
    plain_result = plain.generate("abc", max_new_tokens=30, sampling=greedy)
    assert spec_result.token_ids == plain_result.token_ids
    assert spec_result.text == plain_result.text
    assert spec_result.stats.num_drafted > 0 and plain_result.stats.num_drafted == 0


def test_every_proposer_option_keeps_the_greedy_output(model_dirs):
    greedy = SamplingParams(temperature=0)
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32").generate("abcab", max_new_tokens=30,
                                                                                    sampling=greedy)
    for kwargs in (dict(draft_vocab_limit=10), dict(prompt_lookup=False), dict(draft=None, prompt_lookup=True),
                   dict(draft=None, prompt_lookup="ngram"), dict(prompt_lookup="ngram"),
                   dict(draft_confidence=0.0, num_speculative_tokens=2, draft_vocab_limit=None)):
        kwargs.setdefault("draft", model_dirs["draft"])
        decoder = SpeculativeDecoder(model_dirs["target"], dtype="float32", **kwargs)
        assert decoder.generate("abcab", max_new_tokens=30, sampling=greedy).token_ids == plain.token_ids, kwargs


def test_stream_yields_the_same_text_as_the_result(decoder):
    stream = decoder.generate("abc", max_new_tokens=20, sampling=SamplingParams(seed=1), stream=True)
    text = "".join(event.text for event in stream)
    again = decoder.generate("abc", max_new_tokens=20, sampling=SamplingParams(seed=1))
    assert text == stream.result.text == again.text
    assert stream.result.token_ids == again.token_ids


def test_list_of_prompts_gives_each_prompt_its_own_result(decoder):
    sampling = SamplingParams(seed=3)
    batch = decoder.generate(["abc", [5, 6, 7, 8]], max_new_tokens=10, sampling=sampling)
    assert [r.token_ids for r in batch] == [decoder.generate(p, max_new_tokens=10, sampling=sampling).token_ids
                                            for p in ("abc", [5, 6, 7, 8])]


def test_model_objects_need_a_tokenizer(model_dirs):
    model = tiny_llama(0, vocab=14)
    with pytest.raises(ValueError, match="tokenizer="):
        SpeculativeDecoder(model, None)


def test_a_small_foreign_vocabulary_shared_almost_whole_drafts_through_it(model_dirs):
    """The alien draft's tokenizer holds the target's 14 strings and one more: too few for the
    absolute floor of large vocabularies, but all of this small one (a refusal was a bug)."""
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["alien"], dtype="float32")
    assert decoder.configuration()["draft_vocabulary"]["shared_tokens"] == 14


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens"),
    (dict(dtype="int3"), "dtype must be one of"),
    (dict(draft_confidence=1.0), "draft_confidence"),
    (dict(draft_vocab_limit=0), "draft_vocab_limit"),
])
def test_bad_constructor_arguments_raise(model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], **kwargs)


def test_unknown_model_path_and_offline_hub_id_raise_quickly():
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeDecoder("./no/such/model", None)
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        SpeculativeDecoder("nobody-has/this-model-xyz", None)


@pytest.mark.parametrize("prompt,kwargs,match", [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    ([3, 999], {}, "outside the vocabulary"),
    ("abc", dict(max_new_tokens=0), "max_new_tokens"),
    ("abc", dict(stop=[""]), "non-empty"),
    ("abc", dict(chat=True), "no chat template"),
])
def test_bad_generate_arguments_raise(decoder, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decoder.generate(prompt, **kwargs)


def test_prompt_longer_than_context_window_raises(decoder):
    with pytest.raises(ValueError, match="context window"):
        decoder.generate([5] * 300, max_new_tokens=4)


def test_max_model_len_caps_prompt_and_output_below_the_models_window(model_dirs, capsys):
    capped = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", max_model_len=12)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="context window is 12"):
        capped.generate([5] * 13, max_new_tokens=1)
    result = capped.generate([5, 6, 7, 8, 9], max_new_tokens=50, sampling=greedy)
    assert len(result.token_ids) == 7 and result.finish_reason == "length"  # 5 + 7 = 12 tokens held
    whole = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32")
    assert whole.generate([5, 6, 7, 8, 9], max_new_tokens=7, sampling=greedy).token_ids == result.token_ids
    for bad in (1, 2.5, "9"):
        with pytest.raises(ValueError, match="max_model_len"):
            SpeculativeDecoder(model_dirs["target"], None, max_model_len=bad)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "abc", "--target", model_dirs["target"], "-c", "1"])
    assert exit_.value.code == 2 and "--max-model-len" in capsys.readouterr().err


def test_cli_json_output(model_dirs, capsys):
    code = main(["generate", "abc", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                 "--temperature", "0", "--max-new-tokens", "12", "--dtype", "float32", "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats", "configuration"}
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    configuration = out["configuration"]  # which dtype ran, on which CPU class, and why
    assert configuration["dtype"] == "float32" and configuration["choice"] is None
    assert configuration["machine"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(configuration["machine"]["native_bfloat16"], bool)
    assert out["stats"]["num_drafted"] > 0 and out["stats"]["lossy"] is False


def test_cli_streams_text_and_prints_summary(model_dirs, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("abc")
    code = main(["generate", f"@{prompt_file}", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                 "--seed", "1", "--max-new-tokens", "8", "--dtype", "float32", "--show-tokens"])
    captured = capsys.readouterr()
    assert code == 0
    assert "tokens/s" in captured.err and "acceptance rate" in captured.err
    progress = [line for line in captured.err.splitlines() if line.startswith("loading") or "loading" in line[:20]]
    assert progress and all(line.startswith("specdecode: ") for line in progress)  # the library's own lines
    assert "\033[" in captured.out  # coloured by origin


@pytest.mark.parametrize("args,match", [
    (["--temperature", "-1"], "temperature"),
    (["-k", "0"], "num-speculative-tokens"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--top-p", "1.5"], "--top-p must be in"),
    (["--stop", ""], "stop"),
    (["--draft-confidence", "1.2"], "draft-confidence"),
    (["--draft-vocab-limit", "0"], "draft-vocab-limit"),
])
def test_cli_usage_errors_exit_2_before_loading_models(args, match, capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(["generate", "hello"] + args)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_empty_prompt_and_unknown_model_exit_2(capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(["generate", ""])
    assert exit_info.value.code == 2
    assert main(["generate", "hi", "--target", "./no/such/dir", "--draft", "none"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--target", "--draft", "--num-speculative-tokens", "--temperature", "--top-k", "--top-p",
                 "--min-p", "--seed", "--draft-confidence", "--draft-vocab-limit", "--prompt-lookup", "--no-prompt-lookup", "--max-new-tokens", "--stop", "--dtype", "--raw", "--show-tokens", "--json"):
        assert flag in out


def test_a_stream_interleaved_with_another_request_gives_each_its_result_alone(decoder):
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(seed=2)
    alone_stream = decoder.generate("abc", max_new_tokens=20, sampling=greedy)
    alone_other = decoder.generate("hhh", max_new_tokens=5, sampling=seeded)
    stream = decoder.generate("abc", max_new_tokens=20, sampling=greedy, stream=True)
    events = iter(stream)
    first = next(events)
    other = decoder.generate("hhh", max_new_tokens=5, sampling=seeded)  # shares the engine meanwhile
    rest = list(events)
    assert [first.token_id] + [e.token_id for e in rest] == stream.result.token_ids == alone_stream.token_ids
    assert first.text + "".join(e.text for e in rest) == stream.result.text == alone_stream.text
    assert other.token_ids == alone_other.token_ids and other.text == alone_other.text
    assert not decoder.engine.has_work
    # a finished stream cannot be iterated again
    done = decoder.generate("abc", max_new_tokens=3, stream=True)
    list(done)
    with pytest.raises(RuntimeError, match="only once"):
        list(done)
    assert done.result is not None


def test_token_ids_of_any_integer_type_are_accepted_and_others_refused(decoder):
    import numpy as np

    sampling = SamplingParams(temperature=0)
    reference = decoder.generate([5, 6, 7], max_new_tokens=4, sampling=sampling).token_ids
    assert decoder.generate(list(np.array([5, 6, 7])), max_new_tokens=4, sampling=sampling).token_ids == reference
    assert decoder.generate(list(torch.tensor([5, 6, 7])), max_new_tokens=4, sampling=sampling).token_ids == reference
    for bad in ([5, 6.9], [True, 5]):
        with pytest.raises(ValueError, match="list of integers"):
            decoder.generate(bad, max_new_tokens=4)


def test_a_batch_is_validated_before_anything_is_generated(decoder):
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.generate(["abc", ""], max_new_tokens=4)


@pytest.mark.parametrize("kwargs, flags", [
    ({"sampling": SamplingParams(min_tokens=9)}, ["--min-tokens", "9"]),
    ({"stop": ["", "x"]}, ["--stop", "", "--stop", "x"]),
    ({"logprobs": 21}, ["--logprobs", "21", "--json"]),
    ({"lenience": 0}, ["--lenience", "0"]),
    ({"sampling": SamplingParams(top_p=1.0), "max_new_tokens": -1}, ["--max-new-tokens", "-1"]),
])
def test_a_request_rule_and_its_message_are_the_same_in_the_library_and_the_cli(decoder, kwargs, flags, capsys):
    from specdecode.cli.common import as_flags

    with pytest.raises(ValueError) as library:
        decoder.generate("abc", **{"max_new_tokens": 8, **kwargs})
    with pytest.raises(SystemExit):
        main(["generate", "abc", "--max-new-tokens", "8", *flags])
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    if "max_new_tokens" not in kwargs:  # (the CLI names -1 first: a command never scores a prompt alone)
        assert as_flags(str(library.value)) in err


def test_batch_invariant_takes_the_clis_words_too():
    assert DecoderConfig.from_options(batch_invariant="on").batch_invariant is True
    assert DecoderConfig.from_options(batch_invariant="off").batch_invariant is False
    for bad in ("yes", 1.0, 1, np.True_, 0.0):  # (1.0 == True, but later checks ask `is True`)
        with pytest.raises(ValueError, match="batch_invariant must be"):
            DecoderConfig.from_options(batch_invariant=bad).validate()


def test_request_options_take_numpy_integers_and_refuse_a_stop_that_is_not_text():
    from specdecode.frontend.options import RequestOptions

    options = RequestOptions(np.int64(4), n=np.int64(2), logprobs=np.int64(3), lenience=np.float32(1)).validate()
    assert (options.max_new_tokens, options.n, options.logprobs) == (4, 2, 3) and type(options.n) is int
    for stop in (0, False, [1]):
        with pytest.raises(TypeError, match="stop must be"):
            RequestOptions(stop=stop).validate()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"seed": 1.5}, TypeError, "seed must be an integer or None"), ({"seed": 2**70}, ValueError, "seed must be"),
    ({"top_k": True}, TypeError, "top_k must be an integer"),
    ({"temperature": float("inf")}, ValueError, "temperature must be finite")])
def test_bad_seed_and_booleans_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_cli_refuses_a_prompt_file_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe abc")
    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(["generate", f"@{bad}"])
    assert exit_info.value.code == 2
    assert "cannot read the prompt" in capsys.readouterr().err


def test_quantize_draft_false_means_none_lean_forward_included(model_dirs, char_tokenizer):
    lean = {q: SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", quantize_draft=q,
                                  guard=False).draft.backend._lean is not None for q in (False, "none")}
    assert lean == {False: True, "none": True}


def test_quantize_draft_never_changes_the_users_model(model_dirs, char_tokenizer):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    draft = AutoModelForCausalLM.from_pretrained(model_dirs["draft"])
    greedy = SamplingParams(temperature=0)
    plain = SpeculativeDecoder(target, None, tokenizer=char_tokenizer).generate("abcab", max_new_tokens=20,
                                                                               sampling=greedy)
    from specdecode.config import DEFAULT_DRAFT_QUANTIZATION

    kinds = {None: None, False: None, "none": None, "int8": Int8Linear, "int4": Int4Linear}
    kinds[True] = kinds[DEFAULT_DRAFT_QUANTIZATION]
    for quantize, kind in kinds.items():
        decoder = SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, quantize_draft=quantize)
        assert decoder.generate("abcab", max_new_tokens=20, sampling=greedy).token_ids == plain.token_ids
        assert isinstance(draft.lm_head, torch.nn.Linear)  # the user's object is untouched
        used = decoder.draft.backend.model
        assert (used is not draft and isinstance(used.model.layers[0].mlp.up_proj, kind)) if kind else used is draft
        if kind is Int4Linear:  # the char vocabulary's head has a shape the int4 kernel cannot take
            assert isinstance(used.lm_head, Int8Linear)
        assert used.config._attn_implementation == ("eager" if kind else draft.config._attn_implementation)
    for bad in ("int3", 1):
        with pytest.raises(ValueError, match="quantize_draft must be one of 'auto', 'none', 'int8', 'int4'"):
            SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, quantize_draft=bad)


# --- batches (the engine's rows through generate) --------------------------------------------------

BATCH_PROMPTS = ["abc", [5, 6, 7, 8, 9, 10, 4], "h", "badcafe ge"]


def record_batch_widths(decoder, monkeypatch):
    """The number of rows in each target forward of `decoder` from now on."""
    widths = []
    backend = decoder.target.backend
    real_forward = backend.forward
    monkeypatch.setattr(backend, "forward", lambda feeds, n: widths.append(len(feeds)) or real_forward(feeds, n))
    return widths


def test_a_list_of_prompts_decodes_as_one_batch_and_equals_one_at_a_time(decoder, monkeypatch):
    widths = record_batch_widths(decoder, monkeypatch)
    greedy = SamplingParams(temperature=0)
    batched = decoder.generate(BATCH_PROMPTS, max_new_tokens=15, sampling=greedy, stop=["ee"])
    assert max(widths) == 4
    widths.clear()
    sequential = decoder.generate(BATCH_PROMPTS, max_new_tokens=15, sampling=greedy, stop=["ee"], batch_size=1)
    assert max(widths) == 1
    for got, alone in zip(batched, sequential):
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.finish_reason == alone.finish_reason
    widths.clear()
    assert decoder.generate(BATCH_PROMPTS, max_new_tokens=15, sampling=greedy, batch_size=3)[3].token_ids == \
        decoder.generate(BATCH_PROMPTS[3], max_new_tokens=15, sampling=greedy).token_ids
    assert max(widths) == 3


def test_batched_stop_strings_end_each_row_on_its_own(decoder):
    greedy = SamplingParams(temperature=0)
    stop = decoder.generate(BATCH_PROMPTS[0], max_new_tokens=8, sampling=greedy).text[3:5]  # ends row 0 early
    batched = decoder.generate(BATCH_PROMPTS, max_new_tokens=20, sampling=greedy, stop=stop)
    for prompt, got in zip(BATCH_PROMPTS, batched):
        single = decoder.generate(prompt, max_new_tokens=20, sampling=greedy, stop=stop)
        assert (got.text, got.token_ids, got.finish_reason) == (single.text, single.token_ids, single.finish_reason)
    assert batched[0].finish_reason == "stop" and stop not in batched[0].text


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True, "2"])
def test_bad_batch_size_raises(decoder, batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        decoder.generate(["abc", "de"], max_new_tokens=4, batch_size=batch_size)


def test_lookup_only_decoding_batches_the_rows_and_each_equals_its_run_alone(model_dirs, monkeypatch):
    # n-gram lookup: its drafts come from the row alone (suffix drafts also read earlier requests')
    lookup = SpeculativeDecoder(model_dirs["target"], None, prompt_lookup="ngram", dtype="float32")
    widths = record_batch_widths(lookup, monkeypatch)
    greedy = SamplingParams(temperature=0)
    results = lookup.generate(["abcab", "hh"], max_new_tokens=6, sampling=greedy)
    assert max(widths) == 2  # one batch, not one prompt at a time
    assert [len(r.token_ids) for r in results] == [6, 6]
    for prompt, got in zip(["abcab", "hh"], results):
        alone = lookup.generate(prompt, max_new_tokens=6, sampling=greedy)
        assert got.token_ids == alone.token_ids
        assert got.stats.num_lookup_steps == alone.stats.num_lookup_steps
    assert results[0].stats.num_lookup_steps > 0  # "ab" recurs in "abcab": lookup proposed in the batch
    assert results[0].to_dict()["stats"]["num_lookup_steps"] == results[0].stats.num_lookup_steps


def test_cli_prompts_file_writes_one_json_line_per_prompt(model_dirs, tmp_path, capsys):
    lines = tmp_path / "prompts.txt"
    lines.write_text("abc\n\nhgf\nba\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "abc"}\n{"prompt": "hgf", "id": 7}\n{"prompt": "ba"}\n')
    common = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--temperature", "0",
              "--max-new-tokens", "6", "--dtype", "float32", "--json", "--quiet"]
    outputs = []
    for path, extra in ((lines, []), (jsonl, ["--batch-size", "2"])):
        assert main(["generate", "--prompts-file", str(path)] + common + extra) == 0
        outputs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    strip = [[{key: o[key] for key in ("index", "text", "token_ids", "finish_reason")} for o in out] for out in outputs]
    assert strip[0] == strip[1]
    assert [o["index"] for o in outputs[0]] == [0, 1, 2] and set(outputs[0][0]) == {"index", "text", "token_ids",
                                                                                   "finish_reason", "stats",
                                                                                   "configuration"}
    assert main(["generate", "hgf"] + common) == 0
    single = json.loads(capsys.readouterr().out)
    assert outputs[0][1]["token_ids"] == single["token_ids"] and outputs[0][1]["text"] == single["text"]


def test_cli_prompts_file_prints_each_text_under_a_header(model_dirs, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("abc\nhgf\n")
    assert main(["generate", "--prompts-file", str(path), "--target", model_dirs["target"], "--draft", "none",
                 "--seed", "1", "--max-new-tokens", "5", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert "===== prompt 1/2 =====" in captured.out and "===== prompt 2/2 =====" in captured.out
    assert "prompt 2: 5 tokens" in captured.err


@pytest.mark.parametrize("args,content,match", [
    (["hello", "--prompts-file", "{path}"], "abc\n", "a PROMPT or --prompts-file FILE, not both"),
    ([], None, "give a PROMPT or --prompts-file FILE"),
    (["--prompts-file", "{path}"], "\n\n", "holds no prompts"),
    (["--prompts-file", "{path}.jsonl"], '{"text": "abc"}\n', '"prompt" string'),
    (["--prompts-file", "{path}.jsonl"], "not json\n", "not JSON"),
    (["--prompts-file", "{path}", "--batch-size", "0"], "abc\n", "batch-size"),
    (["--prompts-file", "{path}-missing"], None, "cannot read the prompts"),
    (["hello", "--batch-size", "2"], None, "needs --prompts-file"),
    (["--prompts-file", "{path}", "--show-tokens"], "abc\n", "show-tokens"),
])
def test_cli_prompts_file_usage_errors_exit_2(tmp_path, capsys, args, content, match):
    path = tmp_path / "p"
    if content is not None:
        for suffix in ("", ".jsonl"):
            (tmp_path / ("p" + suffix)).write_text(content)
    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(["generate"] + [a.format(path=path) for a in args])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_a_seeded_sampled_prompt_gives_the_same_output_in_a_list_as_alone(model_dirs):
    # Prompt lookup is on by default and runs per row inside the batch, drawing from each row's
    # own generator exactly as alone. (Each row's first step drafts nothing: the first prompt's
    # output repeats its own tokens, so lookup finds them later.)
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32")
    sampling = SamplingParams(seed=7)
    together = decoder.generate(["aaaaaaa", "hgfe"], max_new_tokens=20, sampling=sampling)
    for prompt, got in zip(("aaaaaaa", "hgfe"), together):
        assert got.token_ids == decoder.generate(prompt, max_new_tokens=20, sampling=sampling).token_ids
    assert together[0].stats.num_lookup_steps > 0
    for prompt in ("aaaaaaa", "hgfe"):
        assert decoder.generate([prompt], max_new_tokens=20, sampling=sampling)[0].token_ids == \
            decoder.generate(prompt, max_new_tokens=20, sampling=sampling).token_ids


def test_the_guard_stays_out_of_seeded_sampling_and_lenient_greedy(model_dirs):
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard_costs=(0.1, 0.0))
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(seed=1)
    assert decoder.requests.config(8, greedy).costs == (0.1, 0.0)
    assert decoder.requests.config(8, SamplingParams()).costs == (0.1, 0.0)
    assert decoder.requests.config(8, seeded).costs is None
    assert decoder.requests.config(8, greedy, lenience=0.5).costs is None
    assert SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], guard=False).guard_costs is None
    # drafter-invariant: a seeded request's tokens do not depend on when drafting pauses
    invariant = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard_costs=(0.1, 0.0),
                                   verification="drafter-invariant")
    assert invariant.requests.config(8, seeded).costs == (0.1, 0.0)


def test_lenience_without_a_draft_is_not_lossy(model_dirs):
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    assert not plain.generate("abc", max_new_tokens=5, lenience=0.5).stats.lossy


def test_generate_takes_logprobs_processors_and_grammars_and_checks_them(decoder, model_dirs):
    greedy = SamplingParams(temperature=0)
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    ban_last = lambda ids, scores: scores.index_fill(1, ids[0, -1:], float("-inf"))  # noqa: E731
    kwargs = dict(max_new_tokens=16, sampling=greedy, logprobs=1, logits_processors=[ban_last],
                  grammar="regex:(ab|cd|ef)+[.]", chat=False)
    spec_result, plain_result = decoder.generate("abc", **kwargs), plain.generate("abc", **kwargs)
    assert spec_result.token_ids == plain_result.token_ids
    assert len(spec_result.logprobs) == len(spec_result.token_ids)
    assert all(a != b for a, b in zip(spec_result.token_ids, spec_result.token_ids[1:]))  # the processor held
    assert [r.token_ids for r in decoder.generate(["abc", "abc"], **kwargs)] == [spec_result.token_ids] * 2
    for bad, message in ((dict(logprobs=21), "logprobs must be"), (dict(logprobs=True), "logprobs must be"),
                         (dict(logits_processors=[1]), "logits_processors must be"),
                         (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
                          "invalid JSON schema"),
                         (dict(grammar="root ::= ("), "invalid grammar"),
                         # the grammar ends the output where only EOS may follow: nothing could come next
                         (dict(grammar='root ::= "a"', sampling=SamplingParams(min_tokens=2)), "cannot be combined"),
                         (dict(response_format={"type": "json_object"}, sampling=SamplingParams(ignore_eos=True)),
                          "cannot be combined")):
        with pytest.raises(ValueError, match=message):
            decoder.generate("abc", max_new_tokens=4, **bad)
    with pytest.raises(TypeError, match="grammar must be a string"):  # not taken for a compiled one
        decoder.generate("abc", max_new_tokens=4, grammar=b'root ::= "a"')
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty must be"):
        SamplingParams(presence_penalty=2.5)


def test_decoder_config_is_importable_from_the_package_and_refuses_infinite_guard_costs():
    from specdecode import DecoderConfig

    with pytest.raises(ValueError, match="finite"):
        DecoderConfig(guard_costs=(0.1, float("inf"))).validate()
    with pytest.raises(ValueError, match="finite"):
        DecoderConfig(guard_costs=(float("nan"), 0.1)).validate()


def test_a_prompt_of_exactly_the_context_length_can_be_scored_but_not_continued(decoder):
    limit = decoder.target.backend.max_length
    scored = decoder.generate([5] * limit, max_new_tokens=0, prompt_logprobs=1)
    assert len(scored.prompt_logprobs) == limit and scored.token_ids == []
    with pytest.raises(ValueError, match="no room for a new token"):
        decoder.generate([5] * limit, max_new_tokens=1)
