"""Grammar-constrained output: the token mask applies to p and q at every position, the
matcher walks drafts and rolls back, drafts that break the grammar are cut, forced tokens cost no
draft forward, and the output is exactly the masked target's."""

import itertools
import json
from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.grammar import GrammarCompiler, parse_response_format
from specdecode.models import HFCausalLM, TableModel
from specdecode.processors import build_pipeline
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams, adjust

from helpers import chi2_pvalue, tiny_llama

pytest.importorskip("xgrammar")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tensors of 5 values: torch's second intra-op thread only waits on a shared CPU (and made
    # these loops ten times slower there)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# --- a 5-token table vocabulary and a tiny grammar: [ab] [abc]* "d", then the stop token -----------

TABLE_TOKENS = ["a", "b", "c", "d", "<e>"]
TABLE_EOS = 4
TABLE_GRAMMAR = 'root ::= [ab] [abc]* "d"'


def table_allowed(generated):
    """The grammar's next tokens, written out by hand (an oracle independent of xgrammar)."""
    if not generated:
        return {0, 1}
    if generated[-1] == 3:
        return {TABLE_EOS}
    return {0, 1, 2, 3}


def masked_sequence_probs(target, prompt, length, params):
    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob = 1.0
        for i in range(length):
            logits = target.logits_for(prompt + list(seq[:i])).clone()
            banned = [t for t in range(target.vocab_size) if t not in table_allowed(list(seq[:i]))]
            logits[banned] = float("-inf")
            prob *= float(adjust(logits, params)[seq[i]])
        probs[seq] = prob
    return probs


@pytest.fixture(scope="module")
def table_grammar():
    return GrammarCompiler.from_vocabulary(TABLE_TOKENS, [TABLE_EOS]).compile(grammar=TABLE_GRAMMAR)


def _table_counts(make_proposer, grammar, runs, **engine_options):
    target, draft = TableModel(5, order=2, seed=30, sharpness=1.5), TableModel(5, order=2, seed=31, sharpness=1.5)
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=3, sampling=SamplingParams(seed=seed), num_speculative_tokens=3,
                              eos_token_ids=frozenset({TABLE_EOS}), grammar=grammar)
        counts[tuple(run(target, make_proposer(draft), [1, 2], config, **engine_options).token_ids)] += 1
    expected = masked_sequence_probs(target, [1, 2], 3, SamplingParams())
    seqs = sorted(expected)
    return [counts[s] for s in seqs], [expected[s] for s in seqs]


def test_the_matcher_agrees_with_the_hand_written_grammar(table_grammar):
    state = table_grammar.state(0)
    for seq in itertools.product(range(4), repeat=3):
        generated = []
        for token in seq:
            allowed = set(torch.isfinite(state(generated, [], torch.zeros(1, 5))[0]).nonzero()[:, 0].tolist())
            assert allowed == table_allowed(generated), generated
            if token not in allowed:
                break
            generated = generated + [token]
        state = table_grammar.state(0)


@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: FallbackProposer(PromptLookupProposer(5, max_ngram=2, min_ngram=1), DraftModelProposer(d)),
], ids=["draft", "lookup+draft"])
@pytest.mark.slow
def test_constrained_sampling_matches_the_masked_target_chi_square(table_grammar, make_proposer):
    # 3000 seeded runs at T = 1 (3 tokens); significance 1e-3. Sequences the grammar forbids have
    # probability 0, so a single one fails the test.
    observed, probs = _table_counts(make_proposer, table_grammar, 3000)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.slow
def test_chi_square_detects_a_mask_on_the_draft_side_only(table_grammar, monkeypatch):
    from specdecode.engine.engine import accept
    from specdecode.grammar import GrammarState

    def lenient_sync(self, committed):  # the broken loop commits forbidden tokens: skip them
        for token in committed[self._consumed:]:
            self.matcher.accept_token(int(token))
        self._consumed = max(self._consumed, len(committed))

    monkeypatch.setattr(GrammarState, "_sync", lenient_sync)
    observed, probs = _table_counts(lambda d: DraftModelProposer(d), table_grammar, 3000,
                                    accept_rule=lambda d, q, logits, config, gen, committed, pipeline=None:
                                    accept(d, q, logits, config, gen, committed))
    assert chi2_pvalue(observed, probs) < 1e-6


def test_matcher_rolls_drafts_back(table_grammar):
    pipeline = build_pipeline(SamplingParams(), 0, 5, grammar=table_grammar)
    logits = torch.zeros(4, 5)
    first = pipeline([0, 2], [], logits[:1])
    rows = pipeline([0, 2], [1, 3, 4], logits)     # positions after the drafts: d ends the grammar
    assert set(torch.isfinite(rows[2]).nonzero()[:, 0].tolist()) == {TABLE_EOS}
    assert pipeline.valid_prefix([0, 2], [1, 3, 0, 1]) == 2  # "a" after "d" breaks it
    assert pipeline.forced([0, 2], [3]) == TABLE_EOS and pipeline.forced([0, 2], []) is None
    assert torch.equal(pipeline([0, 2], [], logits[:1]), first)  # nothing of the drafts stayed


def test_lookup_drafts_that_break_the_grammar_are_cut_before_the_target_call(table_grammar):
    # prompt lookup copies "d a ..." which the grammar refuses after "d": such drafts never reach
    # the target, and the output equals plain constrained decoding
    prompt = [0, 3, 0, 1, 0, 3, 0, 1]
    target = TableModel(5, order=2, seed=30, sharpness=1.5)
    checker = build_pipeline(SamplingParams(), len(prompt), 5, grammar=table_grammar)
    seen = {"fed": 0, "proposed_invalid": 0}
    forward = target.forward

    def checked_forward(feeds, n):
        row = list(target.rows[0])
        committed, drafts = (prompt, feeds[0][len(prompt):]) if not row else (row + feeds[0][:1], feeds[0][1:])
        assert checker.valid_prefix(committed, drafts) == len(drafts), (committed, drafts)
        seen["fed"] += len(drafts)
        return forward(feeds, n)

    target.forward = checked_forward
    lookup = PromptLookupProposer(5, max_ngram=2, min_ngram=1)
    propose = lookup.propose

    def recording_propose(rows, ks):
        drafts = propose(rows, ks)
        for row, draft in zip(rows, drafts):
            ids = draft.tokens.tolist()
            seen["proposed_invalid"] += checker.valid_prefix(row.tokens, ids) < len(ids)
        return drafts

    lookup.propose = recording_propose
    config = DecodeConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0), num_speculative_tokens=4,
                          eos_token_ids=frozenset({TABLE_EOS}), grammar=table_grammar)
    spec = run(target, lookup, prompt, config)
    plain = run(TableModel(5, order=2, seed=30, sharpness=1.5), None, prompt, config)
    assert spec.token_ids == plain.token_ids
    assert seen["proposed_invalid"] > 0 and seen["fed"] > 0


# --- tiny float32 Llamas with a printable-ASCII vocabulary -----------------------------------------

ASCII = [chr(32 + i) for i in range(95)] + ["<eos>"]
ASCII_EOS = 95
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ascii_compiler():
    return GrammarCompiler.from_vocabulary(ASCII, [ASCII_EOS])


def _reference_constrained_greedy(model, prompt, n, grammar):
    """Plain greedy over the full prefix each step, masked by a fresh matcher fed token by token."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar.compiled)
    bitmask = xgr.allocate_token_bitmask(1, 96)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1:].float().clone()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits[0].argmax())
            tokens.append(token)
            assert matcher.accept_token(token)
            if token == ASCII_EOS:
                break
    return tokens[len(prompt):]


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"schema": SCHEMA}}, {"type": "json_object"}],
                         ids=["json_schema", "json_object"])
def test_constrained_greedy_equals_plain_constrained_greedy_and_parses(ascii_compiler, fmt):
    target_model, draft_model = tiny_llama(0, layers=2), tiny_llama(1, layers=1)
    grammar = ascii_compiler.compile(fmt)
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0), num_speculative_tokens=4,
                          eos_token_ids=frozenset({ASCII_EOS}), grammar=grammar)
    prompt = [10, 20, 30, 40]
    spec = run(HFCausalLM(target_model), DraftModelProposer(HFCausalLM(draft_model)), prompt, config)
    plain = run(HFCausalLM(target_model), None, prompt, config)
    assert spec.token_ids == plain.token_ids == _reference_constrained_greedy(target_model, prompt, 40, grammar)
    if spec.finish_reason == "eos":
        document = json.loads("".join(ASCII[t] for t in spec.token_ids[:-1]))
        if fmt["type"] == "json_schema":
            assert set(document) == {"ok", "n"} and isinstance(document["ok"], bool) and 0 <= document["n"] <= 99
    else:
        assert fmt["type"] == "json_object"  # an open-ended object may run to max_new_tokens
    if fmt["type"] == "json_schema":
        assert spec.finish_reason == "eos"


def test_forced_tokens_cost_no_draft_forward(ascii_compiler):
    # a literal: every token is forced, so the draft model never runs and every draft is accepted
    target_model, draft_model = tiny_llama(0, layers=2), tiny_llama(1, layers=1)
    grammar = ascii_compiler.compile(grammar="regex:hello world")
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(seed=0), num_speculative_tokens=4,
                          eos_token_ids=frozenset({ASCII_EOS}), grammar=grammar)
    result = run(HFCausalLM(target_model), DraftModelProposer(HFCausalLM(draft_model)), [10, 20], config)
    assert "".join(ASCII[t] for t in result.token_ids[:-1]) == "hello world" and result.finish_reason == "eos"
    assert result.stats.num_draft_calls == 0 and result.stats.num_drafted == result.stats.num_accepted > 0


@pytest.mark.parametrize("seed", [None, 0], ids=["greedy", "sampled"])
def test_a_grammar_dead_end_ends_the_output_instead_of_failing_the_step(ascii_compiler, seed):
    # after "a" the regex allows nothing: every token masked would give NaN probabilities (a failed
    # step for every request in it); the output ends there with EOS instead
    target_model, draft_model = tiny_llama(0, layers=2), tiny_llama(1, layers=1)
    grammar = ascii_compiler.compile(grammar="regex:a[^\\s\\S]")
    sampling = SamplingParams(temperature=0) if seed is None else SamplingParams(seed=seed)
    config = DecodeConfig(max_new_tokens=8, sampling=sampling, num_speculative_tokens=4,
                          eos_token_ids=frozenset({ASCII_EOS}), grammar=grammar)
    for proposer in (DraftModelProposer(HFCausalLM(draft_model)), None):
        result = run(HFCausalLM(target_model), proposer, [10, 20], config)
        assert [ASCII[t] for t in result.token_ids] == ["a", "<eos>"] and result.finish_reason == "eos"


def test_response_format_errors_are_one_clear_line(ascii_compiler):
    with pytest.raises(ValueError, match="invalid JSON schema: Unsupported type"):
        ascii_compiler.compile({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    with pytest.raises(ValueError, match="invalid grammar: EBNF parser error"):
        ascii_compiler.compile(grammar="root ::= (")
    with pytest.raises(ValueError, match="invalid regex"):
        ascii_compiler.compile(grammar="regex:a(")
    with pytest.raises(ValueError, match="response_format must be"):
        parse_response_format({"type": "xml"})
    with pytest.raises(ValueError, match="json_schema needs"):
        parse_response_format({"type": "json_schema", "json_schema": {}})
    with pytest.raises(ValueError, match="not both"):
        ascii_compiler.compile({"type": "json_object"}, grammar="root ::= \"a\"")
    assert ascii_compiler.compile({"type": "text"}) is None
    # a grammar no token can start would mask a whole first position (NaN probabilities in a step
    # that ends every request in it): refused when compiled
    for empty in ("regex:[^\\s\\S]", "root ::= [^\\x00-\\U0010FFFF]"):
        with pytest.raises(ValueError, match="accepts no text"):
            ascii_compiler.compile(grammar=empty)
    assert ascii_compiler.compile(grammar="regex:a+") is not None
    # keywords the engine accepts without enforcing them are refused, not ignored; a property
    # that happens to be called "not" is a name, not a keyword
    for schema, named in (({"type": "integer", "not": {"const": 1}}, "not"),
                          ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                          ({"$ref": "http://127.0.0.1:9/x"}, "$ref to http://127.0.0.1:9/x"),
                          ({"type": "number", "multipleOf": 3}, "multipleOf")):
        with pytest.raises(ValueError, match="not enforced here") as refused:
            ascii_compiler.compile({"type": "json_schema", "json_schema": {"schema": schema}})
        assert named in str(refused.value)
    named_not = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": ["not"]}}}
    assert ascii_compiler.compile({"type": "json_schema", "json_schema": {"schema": named_not}}) is not None
