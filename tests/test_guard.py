"""The run-time α > c check (paper Cor. 3.9): pauses drafting when speculation loses, keeps
drafting when it wins, is reproducible, and never changes the output distribution."""

import random

import pytest

from specdecode import SamplingParams
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.engine.guard import SpeculationGuard
from specdecode.models import TableModel
from specdecode.proposers import DraftModelProposer
from specdecode.proposers.base import FreeDraftProposer

from helpers import chi2_pvalue, loop_sequence_counts


def steps(guard, n, drafted, forwards, emitted):
    decisions = []
    for _ in range(n):
        speculate = guard.speculate()
        decisions.append(speculate)
        if speculate:
            guard.record(drafted, forwards, emitted)
    return decisions


def steps_of(guard, recorded):
    """Feed recorded steps (drafted, forwards, emitted) to the guard, skipping those it pauses."""
    decisions = []
    for step in recorded:
        decisions.append(guard.speculate())
        if decisions[-1]:
            guard.record(*step)
    return decisions


def test_a_winning_draft_is_never_paused():
    guard = SpeculationGuard(cost_coefficient=0.3, verify_slope=0.02)
    # 3 tokens per call for 1 + 4·0.02 + 4·0.3 = 2.28 target steps: 0.76 per token
    assert all(steps(guard, 100, drafted=4, forwards=4, emitted=3))
    assert guard.num_pauses == 0


def test_a_winning_draft_with_uneven_steps_is_never_paused():
    # c = 0.1: every step costs 1 + 8·0.01 + 8·0.1 = 1.88 target steps and emits 1 or 8 tokens,
    # 0.42 steps per token on average. (An average of the per-step ratios, 1.88 and 0.235, would
    # say 1.06 and pause: the cost per token is a ratio of sums.)
    guard = SpeculationGuard(cost_coefficient=0.1, verify_slope=0.01)
    decisions = []
    for i in range(100):
        decisions += steps(guard, 1, drafted=8, forwards=8, emitted=1 if i % 2 else 8)
    assert all(decisions) and guard.num_pauses == 0


# A Spec-Bench chat answer's speculative steps on the default pair, unguarded (drafts verified,
# draft forwards, tokens emitted), in order: 82 tokens in 45 steps, about half the drafts accepted.
CHAT_ANSWER = [(3, 3, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), (2, 2, 3), (3, 3, 1), (3, 3, 3),
               (7, 7, 1), (7, 7, 8), (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), (2, 2, 3), (1, 1, 1),
               (3, 3, 2), (5, 5, 2), (1, 1, 2), (8, 8, 2), (8, 8, 1), (1, 1, 1), (1, 1, 1), (3, 3, 1),
               (7, 7, 7), (4, 4, 1), (1, 1, 2), (2, 2, 2), (3, 3, 3), (2, 2, 1), (1, 1, 2), (1, 1, 2),
               (1, 1, 2), (1, 1, 2), (1, 1, 1), (1, 1, 1), (2, 2, 1), (2, 2, 1), (2, 2, 1), (1, 1, 1),
               (2, 2, 1), (1, 1, 1), (1, 1, 2), (1, 1, 2), (1, 1, 2)]


def test_a_paying_draft_that_starts_with_misses_is_not_paused():
    # At the default pair's costs (c = 0.11, r(2) = 1.04) these steps cost 0.72 target steps a
    # token, yet four of the first five emit one token. A 5-step mean paused this answer five
    # times for 16 steps; the standard error says four steps are too few to tell.
    costs = (0.11, 0.002, 0.04)
    cost = sum(1 + costs[2] + costs[1] * d + costs[0] * f for d, f, _ in CHAT_ANSWER)
    assert cost / sum(e for *_, e in CHAT_ANSWER) < 0.75
    guard = SpeculationGuard(*costs)
    assert all(steps_of(guard, CHAT_ANSWER)) and guard.num_pauses == 0
    # the earlier rule (a 5-step mean, 4 steps of warm-up, no error margin) pauses these steps
    earlier = SpeculationGuard(*costs, decay=0.8, warmup=4, margin=0.0)
    assert not all(steps_of(earlier, CHAT_ANSWER)) and earlier.num_pauses >= 2
    # the same steps priced where drafting is dear (c = 0.6): paused
    dear = SpeculationGuard(0.6, 0.22, 0.18)
    assert not all(steps_of(dear, CHAT_ANSWER)) and dear.num_pauses > 0


def test_a_losing_draft_is_paused_and_probed_again():
    guard = SpeculationGuard(cost_coefficient=0.3, probe_every=16, warmup=4)
    decisions = steps(guard, 100, drafted=4, forwards=4, emitted=2)  # 2.2 / 2 = 1.1 > 1
    assert decisions[:4] == [True] * 4 and decisions[4:20] == [False] * 16 and decisions[20]
    assert sum(decisions) <= 4 + 100 // 16 + 1


def test_the_verify_cost_can_tip_the_balance():
    # 1.9 tokens per call with 3 free drafts (prompt lookup: no draft forwards)
    assert all(steps(SpeculationGuard(0.0, verify_slope=0.0), 50, drafted=3, forwards=0, emitted=1))
    assert not all(steps(SpeculationGuard(0.0, verify_slope=0.5), 50, drafted=3, forwards=0, emitted=2))


def test_speculation_resumes_when_it_starts_to_pay():
    guard = SpeculationGuard(cost_coefficient=0.3, probe_every=4, warmup=1)
    steps(guard, 20, drafted=4, forwards=4, emitted=1)
    later = steps(guard, 80, drafted=4, forwards=4, emitted=4)
    assert all(later[-20:])


@pytest.mark.parametrize("kwargs", [dict(cost_coefficient=-1), dict(verify_slope=-1), dict(verify_base=-1),
                                    dict(probe_every=0), dict(margin=-0.5),
                                    dict(decay=1.0), dict(warmup=0)])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError, match=r"need cost_coefficient, verify_slope, verify_base, margin >= 0, probe_every >= 1, "
                                         r"decay in \[0, 1\), warmup >= 1"):
        SpeculationGuard(**{"cost_coefficient": 0.1, **kwargs})


def wrong_pair():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    draft.table = -draft.table  # the greedy draft proposes the target's least likely token
    return target, draft


def test_the_loop_stops_calling_a_draft_that_does_not_pay_and_keeps_the_greedy_output():
    target, draft = wrong_pair()
    greedy = SamplingParams(temperature=0)
    plain = run(target, None, [1, 2], DecodeConfig(max_new_tokens=80, sampling=greedy))
    guarded = run(target, DraftModelProposer(draft), [1, 2], DecodeConfig(
        max_new_tokens=80, sampling=greedy, num_speculative_tokens=3, costs=(0.3, 0.0)))
    assert guarded.token_ids == plain.token_ids
    assert guarded.stats.num_target_calls == 80  # α = 0: one token per call either way
    assert guarded.stats.num_draft_calls <= 3 * (4 + 80 // 16 + 1)  # warm-up, then one probe per pause
    assert guarded.stats.num_guard_pauses > 0
    assert guarded.stats.to_dict()["num_guard_pauses"] == guarded.stats.num_guard_pauses
    unguarded = run(target, DraftModelProposer(draft), [1, 2],
                    DecodeConfig(max_new_tokens=80, sampling=greedy, num_speculative_tokens=3))
    assert unguarded.stats.num_draft_calls > 3 * guarded.stats.num_draft_calls
    assert unguarded.stats.num_guard_pauses == 0


def test_a_guarded_sampled_request_is_reproducible_from_its_seed():
    target, draft = TableModel(6, seed=0, sharpness=1.0), TableModel(6, seed=1, sharpness=1.0)
    config = DecodeConfig(max_new_tokens=200, sampling=SamplingParams(seed=7), num_speculative_tokens=4,
                          costs=(0.4, 0.05))
    first = run(target, DraftModelProposer(draft), [1, 2], config)
    assert run(target, DraftModelProposer(draft), [1, 2], config).token_ids == first.token_ids


class CoinGuard(SpeculationGuard):
    """Pauses at random (its own RNG): every mix of plain and speculative steps shows up."""

    rng = random.Random(0)
    decisions: list[bool] = []

    def speculate(self):
        speculate = self.rng.random() < 0.5
        self.decisions.append(speculate)
        return speculate


@pytest.mark.slow
def test_guarded_loop_keeps_the_target_distribution_chi_square(monkeypatch):
    monkeypatch.setattr("specdecode.engine.policy.SpeculationGuard", CoinGuard)
    observed, probs = loop_sequence_counts(lambda d: DraftModelProposer(d), SamplingParams(), runs=3000,
                                           costs=(0.1, 0.0))
    assert chi2_pvalue(observed, probs) > 1e-3
    assert True in CoinGuard.decisions and False in CoinGuard.decisions  # the engine asked the coin


def test_free_drafts_alone_are_guarded_with_no_draft_cost(model_dirs):
    from specdecode import SpeculativeDecoder

    decoder = SpeculativeDecoder(model_dirs["target"], None, free_drafts="suffix", dtype="float32")
    c, slope, base = decoder.guard_costs
    assert c == 0.0 and slope >= 0.0 and base >= 0.0  # a free draft costs no forward; its verify does cost
    assert SpeculativeDecoder(model_dirs["target"], None, free_drafts="suffix", guard=False).guard_costs is None
    assert SpeculativeDecoder(model_dirs["target"], None).guard_costs is None  # plain decoding: nothing to guard
    # a verify priced at two steps per drafted token never pays: every free draft is declined,
    # and the greedy output is the same either way
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    prompt = "abcdabcebcadbcea" * 3
    priced = SpeculativeDecoder(model_dirs["target"], None, free_drafts="suffix", dtype="float32",
                                guard_costs=(0.0, 2.0))
    free = SpeculativeDecoder(model_dirs["target"], None, free_drafts="suffix", dtype="float32", guard=False)
    paused, unguarded = (d.generate(prompt, max_new_tokens=64, sampling=greedy, chat=False) for d in (priced, free))
    assert paused.token_ids == unguarded.token_ids
    assert unguarded.stats.num_drafted > 0 and paused.stats.num_drafted == 0
    assert paused.stats.num_free_declined > 0 and unguarded.stats.num_free_declined == 0


def test_the_verify_line_fits_r2_and_r_gamma_plus_1_and_never_goes_negative():
    from specdecode.tune.timing import verify_line

    slope, base = verify_line(1.40, 2.96, 8)  # a Q4_K_M target on llama.cpp
    assert slope == pytest.approx(0.2229, abs=1e-3) and base == pytest.approx(0.1771, abs=1e-3)
    assert verify_line(1.24, 1.06, 8) == pytest.approx((0.0, 0.06))  # AMX torch: r falls; the wide call's cost
    assert verify_line(1.05, 2.6, 8) == pytest.approx((0.2, 0.0))   # concave: the line from r(1)
    assert verify_line(1.3, 1.3, 1) == pytest.approx((0.0, 0.3))


# --- free drafts: each priced on its own (Eq. 1 against the verify cost) ------------------------------

def test_a_free_draft_is_verified_as_far_as_eq_1_says_it_pays():
    guard = SpeculationGuard(0.0, verify_slope=0.25)
    # prior α = 8/9.5 for an 8-token match: E_j / (1 + j/4) peaks at j = 4 (1.79 tokens per unit cost)
    assert guard.keep(8, 8) == 4
    for _ in range(5):
        guard.record_free(8, accepted=8, verified=8)
    assert guard.keep(8, 8) == 8  # α ≈ 0.97 now: the whole draft
    for _ in range(3):
        guard.record_free(2, accepted=0, verified=1)
    # α = (0 + 2/3.5·2) / (3 + 2) = 0.23 for 2-token matches: 1.23 tokens for 1.25 is less than a
    # plain step gives; the 8-token matches keep their own record
    assert guard.keep(2, 4) == 0 and guard.keep(8, 8) == 8
    assert SpeculationGuard(0.0, verify_slope=2.0).keep(8, 8) == 0  # a verify this dear never pays
    assert SpeculationGuard(0.0, verify_slope=0.0).keep(2, 4) == 4  # a free verify always does
    # a fixed cost for any verify (r(2) = 1.4 on a Q4_K_M llama.cpp target) declines what the
    # slope alone would take: α = 0.34 gives 1.34 tokens for 1.22 without it, for 1.4 with it
    guard, based = SpeculationGuard(0.0, 0.22), SpeculationGuard(0.0, 0.22, verify_base=0.18)
    for g in (guard, based):
        g.record_free(2, accepted=4, verified=13)
    assert guard.keep(2, 4) == 1 and based.keep(2, 4) == 0


def test_free_draft_steps_do_not_pause_the_draft_model():
    guard = SpeculationGuard(0.3, verify_slope=0.25, warmup=1)
    for _ in range(10):
        guard.record_free(2, accepted=0, verified=1)
    assert guard.speculate() and guard.num_pauses == 0


class ScriptedFreeDrafts(FreeDraftProposer):
    """Free drafts of known quality: at even lengths the true continuation `truth` (an 8-token
    match), at odd ones a wrong token repeated (a 2-token match)."""

    def __init__(self, vocab_size, truth):
        super().__init__(vocab_size)
        self.truth = truth

    def find(self, b, row, k):
        n = len(row.tokens)
        if n % 2 == 0:
            return self.truth[n:n + k], 8
        return [(self.truth[n] + 1) % self.vocab_size] * k, 2


def test_weak_free_drafts_are_declined_and_strong_ones_kept_with_the_greedy_output_unchanged():
    target = TableModel(8, seed=3)
    greedy = SamplingParams(temperature=0)
    plain = run(target, None, [1, 2], DecodeConfig(max_new_tokens=60, sampling=greedy))
    truth = [1, 2] + plain.token_ids + [0] * 8
    config = DecodeConfig(max_new_tokens=60, sampling=greedy, num_speculative_tokens=4, costs=(0.0, 0.25))
    priced = run(target, ScriptedFreeDrafts(8, truth), [1, 2], config)
    unpriced = run(target, ScriptedFreeDrafts(8, truth), [1, 2], DecodeConfig(
        max_new_tokens=60, sampling=greedy, num_speculative_tokens=4))
    assert priced.token_ids == unpriced.token_ids == plain.token_ids
    assert priced.stats.num_free_declined >= 3 and unpriced.stats.num_free_declined == 0
    # the weak drafts stop being verified after a few misses; the strong ones never do
    assert priced.stats.num_rejected <= 4 < unpriced.stats.num_rejected
    assert priced.stats.num_accepted >= 0.8 * unpriced.stats.num_accepted


def test_a_cost_that_is_not_a_finite_number_leaves_the_old_one():
    guard = SpeculationGuard(0.2, 0.05)
    guard.set_costs(float("nan"), float("inf"))
    assert (guard.c, guard.slope) == (0.2, 0.05)
    guard.set_costs(0.3, 0.1)
    assert (guard.c, guard.slope) == (0.3, 0.1)
