"""The decoding loop's bookkeeping: acceptance counts, cache rollback, stops, seeds (docs/exactness.md)."""

from types import SimpleNamespace

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import BONUS, CORRECTED, TARGET, DecodeConfig
from specdecode.models import TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import chi2_pvalue, decode, drain, loop_sequence_counts

GREEDY = SamplingParams(temperature=0)


def config(max_new_tokens=20, k=4, sampling=GREEDY, **kw):
    return DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, num_speculative_tokens=k, **kw)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(seed=3), SamplingParams(top_p=0.5, seed=4)],
                         ids=["greedy", "t1", "topp"])
def test_identical_draft_accepts_every_token(sampling):
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    result = run(target, DraftModelProposer(draft), [1, 2, 3], config(200, k=4, sampling=sampling))
    s = result.stats
    assert len(result.token_ids) == 200
    assert s.acceptance_rate == 1.0
    assert s.num_target_calls == 40 and s.mean_tokens_per_call == 5.0
    assert s.accepted_per_position == [40, 40, 40, 40]
    assert result.origins.count(BONUS) == 40 and CORRECTED not in result.origins


def test_always_wrong_draft_accepts_nothing_and_emits_one_token_per_call():
    target = TableModel(8, seed=0)
    draft = TableModel(8, seed=0)
    draft.table = -draft.table  # greedy draft proposes the target's least likely token
    result = run(target, DraftModelProposer(draft), [1, 2, 3], config(50, k=3))
    s = result.stats
    assert s.num_accepted == 0 and s.acceptance_rate == 0.0
    assert s.num_target_calls == 50 and s.mean_tokens_per_call == 1.0
    # the last step has room for one token only, so it drafts nothing (γ clipped to 0)
    assert set(result.origins[:-1]) == {CORRECTED} and result.origins[-1] == TARGET


def test_speculative_greedy_equals_plain_greedy_with_table_models():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=5)
    plain = run(target, None, [1, 2], config(64))
    for k in (1, 2, 5):
        spec = run(target, DraftModelProposer(draft), [1, 2], config(64, k=k))
        assert spec.token_ids == plain.token_ids
        assert 0 < spec.stats.num_accepted < spec.stats.num_drafted
    assert set(plain.origins) == {TARGET}


class CheckedTable(TableModel):
    """One row. Records, at each forward, the cache contents, the feed and how many tokens were
    committed so far; and the cache contents after the last truncate (the rollback)."""

    def __init__(self, *args, committed, **kw):
        super().__init__(*args, **kw)
        self.committed = committed
        self.snapshots = []
        self.after_truncate = None

    def forward(self, feeds, num_logits):
        assert len(feeds) == 1
        self.snapshots.append((list(self.rows[0]), list(feeds[0]), len(self.committed)))
        return super().forward(feeds, num_logits)

    def truncate(self, lengths):
        super().truncate(lengths)
        self.after_truncate = list(self.rows[0])


class MaxLengthTable(TableModel):
    """Records the most tokens any row held (the row leaves the backend when it finishes)."""

    max_seen = 0

    def forward(self, feeds, num_logits):
        out = super().forward(feeds, num_logits)
        self.max_seen = max([self.max_seen] + self.lengths)
        return out


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(seed=1)], ids=["greedy", "t1"])
@pytest.mark.parametrize("lookup", [False, True], ids=["draft", "lookup+draft"])
def test_caches_hold_exactly_the_committed_prefix_after_every_step(sampling, lookup):
    prompt = [1, 2, 3]
    committed = list(prompt)
    target = CheckedTable(8, seed=0, committed=committed)
    draft = CheckedTable(8, seed=7, committed=committed)
    proposer = DraftModelProposer(draft)
    if lookup:  # the draft model sits out the steps that lookup serves, then catches up
        proposer = FallbackProposer(PromptLookupProposer(8, max_ngram=2, min_ngram=1), proposer)
    # the tables check each call against `committed`, so it grows as the tokens come
    _, result = drain(decode(target, proposer, prompt, config(60, k=3, sampling=sampling)),
                      lambda event: committed.append(event.token_id))
    assert len(committed) == len(prompt) + 60 and result.token_ids == committed[len(prompt):]
    # Target: each call starts from the committed sequence minus its last token, fed first.
    for i, (cache, fed, n) in enumerate(target.snapshots):
        if i == 0:
            assert cache == [] and fed[:len(prompt)] == prompt
        else:
            assert cache == committed[:n - 1] and fed[0] == committed[n - 1]
    # after the last step's rollback: everything committed but the last token, which is pending
    assert target.after_truncate == committed[:-1]
    # Draft: each proposal starts from a committed prefix that its first feed completes.
    first_forward_of_step = {}
    for cache, fed, n in draft.snapshots:
        first_forward_of_step.setdefault(n, (cache, fed))
    if not lookup:
        steps_with_drafts = sum(len(fed) > 1 for _, fed, _ in target.snapshots[1:]) + 1
        assert len(first_forward_of_step) == steps_with_drafts
    else:
        assert result.stats.num_lookup_steps > 0 and len(first_forward_of_step) < len(target.snapshots)
    for n, (cache, fed) in first_forward_of_step.items():
        assert cache + fed == committed[:n]


def test_eos_inside_an_accepted_block_ends_the_output_there():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    full = run(target, DraftModelProposer(draft), [1, 2], config(30, k=5)).token_ids
    j = next(i for i in range(3, 30) if full[i] not in full[:i] and i % 6 not in (0, 5))
    result = run(target, DraftModelProposer(draft), [1, 2], config(30, k=5, eos_token_ids=frozenset({full[j]})))
    assert result.token_ids == full[:j + 1]
    assert result.finish_reason == "eos"
    assert result.stats.num_generated == j + 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 6, 7, 11, 13])
def test_block_that_would_overshoot_max_new_tokens_is_cut_exactly(max_new_tokens):
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    result = run(target, DraftModelProposer(draft), [1, 2], config(max_new_tokens, k=4))
    assert len(result.token_ids) == max_new_tokens
    assert result.finish_reason == "length"
    full = run(target, None, [1, 2], config(20)).token_ids
    assert result.token_ids == full[:max_new_tokens]


def test_context_window_clips_gamma_and_ends_with_length():
    target = MaxLengthTable(8, seed=0, max_length=20)
    draft = MaxLengthTable(8, seed=0, max_length=20)
    result = run(target, DraftModelProposer(draft), [1, 2, 3, 4, 5], config(100, k=4))
    assert len(result.token_ids) == 15  # 5 prompt tokens + 15 = the 20-token window
    assert result.finish_reason == "length"
    assert 0 < target.max_seen <= 20 and 0 < draft.max_seen <= 20


def test_same_seed_gives_same_output_and_other_seeds_differ():
    target, draft = TableModel(8, seed=0, sharpness=0.5), TableModel(8, seed=3, sharpness=0.5)
    outs = [run(target, DraftModelProposer(draft), [1], config(30, k=3, sampling=SamplingParams(seed=s))).token_ids
            for s in (7, 7, 8)]
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_stop_string_spanning_two_tokens(char_tokenizer):
    vocab = len(char_tokenizer)
    target, draft = TableModel(vocab, seed=0, sharpness=0.5), TableModel(vocab, seed=2, sharpness=0.5)
    prompt = char_tokenizer.encode("ab")
    sampling = SamplingParams(seed=5)
    full = run(target, DraftModelProposer(draft), prompt, config(40, k=3, sampling=sampling), char_tokenizer)
    ids = [t for t in full.token_ids]
    # choose a two-token stop string that first occurs after a few tokens
    pieces = [char_tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    text = "".join(pieces)
    j = next(i for i in range(4, 39) if pieces[i] and pieces[i + 1] and (pieces[i] + pieces[i + 1]) not in text[:sum(map(len, pieces[:i + 1]))])
    stop = pieces[j] + pieces[j + 1]
    result = run(target, DraftModelProposer(draft), prompt,
                 config(40, k=3, sampling=sampling, stop=(stop,)), char_tokenizer)
    assert result.finish_reason == "stop"
    assert result.text == text[:text.index(stop)]
    assert result.token_ids == ids[:j + 2]


def test_streamed_text_equals_final_text(char_tokenizer):
    vocab = len(char_tokenizer)
    target, draft = TableModel(vocab, seed=0, sharpness=0.5), TableModel(vocab, seed=2, sharpness=0.5)
    cfg = config(40, k=3, sampling=SamplingParams(seed=5), stop=("hh",))
    events, result = drain(decode(target, DraftModelProposer(draft), char_tokenizer.encode("ab"), cfg, char_tokenizer))
    assert "".join(event.text for event in events) == result.text
    assert result.text == run(target, DraftModelProposer(draft), char_tokenizer.encode("ab"), cfg,
                              char_tokenizer).text


def test_confidence_stop_drafts_fewer_tokens_and_keeps_greedy_output():
    target, draft = TableModel(8, seed=0, sharpness=1.0), TableModel(8, seed=5, sharpness=1.0)
    plain = run(target, None, [1, 2], config(60))
    fixed = run(target, DraftModelProposer(draft), [1, 2], config(60, k=6))
    early = run(target, DraftModelProposer(draft, confidence_threshold=0.6), [1, 2], config(60, k=6))
    assert early.token_ids == fixed.token_ids == plain.token_ids
    assert early.stats.num_drafted < fixed.stats.num_drafted
    assert early.stats.acceptance_rate > fixed.stats.acceptance_rate


def test_prompt_lookup_proposes_what_followed_the_latest_match_per_row():
    proposer = PromptLookupProposer(10, max_ngram=3, min_ngram=1)
    sequences = [[1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], [1, 2, 3]]
    for tokens in sequences:
        proposer.add_row(tokens)
    rows = [SimpleNamespace(tokens=tokens, sampling=GREEDY, generator=None) for tokens in sequences]
    draft, none = proposer.propose(rows, [3, 3])
    assert draft.tokens.tolist() == [5, 6, 2]  # latest "2 3" is followed by 5 6 2
    assert torch.equal(draft.probs, torch.nn.functional.one_hot(draft.tokens, 10).float())
    assert draft.lookup and draft.forwards == 0
    assert none.tokens.numel() == 0 and not none.lookup  # no match and no fallback: nothing proposed


def test_prompt_lookup_alone_keeps_greedy_output():
    target = TableModel(5, seed=0, sharpness=1.0)
    plain = run(target, None, [1, 2, 3, 1, 2], config(60))
    spec = run(target, PromptLookupProposer(5, max_ngram=3, min_ngram=1), [1, 2, 3, 1, 2], config(60, k=4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_accepted > 0 and spec.stats.num_target_calls < 60


def test_draft_with_a_larger_vocabulary_than_the_target():
    target, draft = TableModel(6, seed=0), TableModel(8, seed=1)
    plain = run(target, None, [1, 2], config(40))
    spec = run(target, DraftModelProposer(draft), [1, 2], config(40, k=3))
    assert spec.token_ids == plain.token_ids and max(spec.token_ids) < 6


@pytest.mark.parametrize("prompt_length", range(3, 10))
def test_speculative_and_plain_stop_at_the_same_context_length(prompt_length):
    target = TableModel(8, seed=0, max_length=20)
    prompt = [i % 7 + 1 for i in range(prompt_length)]
    plain = run(target, None, prompt, config(100))
    spec = run(target, DraftModelProposer(TableModel(8, seed=0)), prompt, config(100, k=4))
    assert spec.token_ids == plain.token_ids
    assert len(prompt) + len(spec.token_ids) == 20 and spec.finish_reason == "length"


def test_draft_context_window_is_respected():
    target = TableModel(8, seed=0)
    draft = MaxLengthTable(8, seed=0, max_length=12)
    plain = run(target, None, [1, 2, 3], config(30))
    spec = run(target, DraftModelProposer(draft), [1, 2, 3], config(30, k=4))
    assert spec.token_ids == plain.token_ids
    assert 0 < draft.max_seen <= 12 and spec.stats.num_drafted > 0


def test_nothing_after_a_stop_is_counted():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    first = run(target, None, [1, 2], config(1)).token_ids[0]
    result = run(target, DraftModelProposer(draft), [1, 2], config(30, k=5, eos_token_ids=frozenset({first})))
    s = result.stats
    assert result.token_ids == [first]
    assert s.num_accepted == 1 and s.num_drafted == 1 and s.accepted_per_position == [1, 0, 0, 0, 0]


@pytest.mark.slow
def test_alpha_estimate_measures_the_per_token_acceptance_probability():
    # Context-free tables: β = Σ min(p, q) is the same after every prefix, so α = β exactly.
    target, draft = TableModel(6, order=1, seed=0), TableModel(6, order=1, seed=1)
    target.table[:] = target.table[0]
    draft.table[:] = draft.table[0]
    beta = float(torch.minimum(torch.softmax(target.table[0], -1), torch.softmax(draft.table[0], -1)).sum())
    s = run(target, DraftModelProposer(draft), [1], config(4000, k=4, sampling=SamplingParams(seed=0))).stats
    verified = s.num_accepted + s.num_rejected
    # binomial standard error over ~2000 verified drafts is ≈ 0.01; 4 of them is the tolerance
    assert abs(s.alpha_estimate - beta) < 4 * (beta * (1 - beta) / verified) ** 0.5
    # accepted / drafted is E[accepted] / γ = β(1 − β^γ) / ((1 − β)γ) instead (i.i.d. acceptances)
    assert s.acceptance_rate == pytest.approx(beta * (1 - beta ** 4) / ((1 - beta) * 4), abs=0.03)
    assert s.acceptance_rate < s.alpha_estimate


def test_adaptive_gamma_grows_while_blocks_are_accepted_and_shrinks_after_misses():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)  # identical: every block accepted
    calls = []
    proposer = DraftModelProposer(draft)
    real_propose = proposer.propose
    proposer.propose = lambda rows, ks: calls.extend(ks) or real_propose(rows, ks)
    run(target, proposer, [1, 2, 3], config(200, k=12, gamma_schedule="adaptive"))
    assert calls[:6] == [4, 6, 8, 10, 12, 12]
    wrong = TableModel(8, seed=0)
    wrong.table = -wrong.table
    calls.clear()
    proposer = DraftModelProposer(wrong)
    real_propose = proposer.propose
    proposer.propose = lambda rows, ks: calls.extend(ks) or real_propose(rows, ks)
    run(target, proposer, [1, 2, 3], config(20, k=12, gamma_schedule="adaptive"))
    assert calls[:5] == [4, 3, 2, 1, 1]


@pytest.mark.slow
def test_adaptive_gamma_keeps_the_target_distribution_chi_square():
    observed, probs = loop_sequence_counts(lambda d: DraftModelProposer(d, 0.5), SamplingParams(), runs=3000,
                                           gamma_schedule="adaptive")
    assert chi2_pvalue(observed, probs) > 1e-3
