"""The engine's step API (add / step / abort): rows that join and leave between steps, each
exactly what it would be alone (docs/exactness.md rule 7), caches that hold exactly the committed prefix
after every step (rule 5), on table models (exact logits) and tiny float32 Llamas."""

import math

import pytest
import torch

from helpers import FakeClock, tiny_llama
from specdecode import SamplingParams
from specdecode.engine.driver import Driver, run, run_all
from specdecode.engine.engine import Engine
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here")])]


def config(n=24, temperature=0.0, seed=None, k=3, **kw):
    return DecodeConfig(max_new_tokens=n, sampling=SamplingParams(temperature=temperature, seed=seed),
                        num_speculative_tokens=k, **kw)


def tables(vocab=8):
    return TableModel(vocab, seed=0, sharpness=1.0), TableModel(vocab, seed=1, sharpness=1.0)


MIXED = [config(temperature=0.0), config(temperature=0.7, seed=11), config(temperature=0.0, k=5),
         config(temperature=1e-6, seed=3), config(temperature=1.0, seed=5, k=1)]
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 1, 2], [3, 3], [2, 7, 1]]


def solo(target, draft, prompt, cfg, **kw):
    return run(target, DraftModelProposer(draft, **kw), prompt, cfg)


def test_mixed_temperatures_in_one_batch_each_equal_their_solo_runs_without_nan():
    target, draft = tables()
    batch = run_all(target, DraftModelProposer(draft), [Request(p, c) for p, c in zip(PROMPTS, MIXED)])
    for prompt, cfg, got in zip(PROMPTS, MIXED, batch):
        alone = solo(target, draft, prompt, cfg)
        assert got.token_ids == alone.token_ids
        assert got.stats.num_accepted == alone.stats.num_accepted
        assert len(got.token_ids) == cfg.max_new_tokens and not math.isnan(got.stats.acceptance_rate)
    # the near-zero temperature row samples, but as surely as greedy would
    greedy = solo(target, draft, PROMPTS[3], config())
    assert batch[3].token_ids == greedy.token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_temperatures_with_tiny_llamas_each_equal_their_solo_runs(device):
    target = HFCausalLM(tiny_llama(0).to(device))
    draft = HFCausalLM(tiny_llama(1, layers=1).to(device))
    prompts = [[5, 17, 33, 2], [9, 9, 41], [70, 3, 3, 8, 1, 2], [11]]
    cfgs = [config(16), config(16, temperature=1e-6, seed=1), config(16, k=5), config(16, k=1)]
    batch = run_all(target, DraftModelProposer(draft), [Request(p, c) for p, c in zip(prompts, cfgs)])
    for prompt, cfg, got in zip(prompts, cfgs, batch):
        assert got.token_ids == run(target, None, prompt, cfg).token_ids  # = plain greedy alone


def test_a_row_that_joins_mid_flight_equals_its_solo_run():
    target, draft = tables()
    engine = Engine(target, DraftModelProposer(draft))
    driver = Driver(engine)
    first = driver.submit(Request(PROMPTS[0], MIXED[1]))
    for _ in range(3):
        driver.step()
    assert len(engine.running) == 1 and len(engine.running[0].tokens) > len(PROMPTS[0])
    late = driver.submit(Request(PROMPTS[2], MIXED[4]))
    # both results before any solo run: a solo run resets the backends the engine shares
    late_result, first_result = driver.result(late), driver.result(first)
    assert late_result.token_ids == solo(target, draft, PROMPTS[2], MIXED[4]).token_ids
    assert first_result.token_ids == solo(target, draft, PROMPTS[0], MIXED[1]).token_ids


class FeedLog(HFCausalLM):
    """Records the widest feed of every batched forward."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.widths = []

    def forward(self, feeds, num_logits):
        self.widths.append((len(feeds), max(len(f) for f in feeds)))
        return super().forward(feeds, num_logits)


def test_a_row_joining_others_reads_its_prompt_alone_and_no_feed_is_padded_to_it():
    # Reading a long prompt inside the batched forward would pad every other row's feed to its
    # length (B × L token reads); joining rows read it in a forward of their own instead.
    target, draft = FeedLog(tiny_llama(0)), FeedLog(tiny_llama(1, layers=1))
    long_prompt = list(range(3, 43))
    engine = Engine(target, DraftModelProposer(draft))
    driver = Driver(engine)
    first = driver.submit(Request([5, 17, 33, 2], config(20, k=3)))
    driver.step()
    late = [driver.submit(Request(long_prompt, config(12, k=3))), driver.submit(Request([9, 9, 41], config(12)))]
    results = [driver.result(i) for i in [first, *late]]
    batched = [w for b, w in target.widths + draft.widths if b > 1]
    assert batched and max(batched) <= 4  # a verify of k = 3 drafts, never the 40-token prompt
    for prompt, got in zip([[5, 17, 33, 2], long_prompt, [9, 9, 41]], results):
        assert got.token_ids == run(target, None, prompt, config(len(got.token_ids))).token_ids


def test_an_aborted_row_frees_its_slot_and_changes_no_other_row():
    target, draft = tables()
    engine = Engine(target, DraftModelProposer(draft), max_batch_size=2)
    driver = Driver(engine)
    ids = [driver.submit(Request(p, c)) for p, c in zip(PROMPTS[:3], MIXED[:3])]
    driver.step()
    driver.step()
    assert [row.request_id for row in engine.running] == ids[:2] and len(engine.waiting) == 1
    aborted = engine.abort(ids[0])
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < MIXED[0].max_new_tokens
    assert target.num_rows == 1 and draft.num_rows == 1
    driver.step()  # the waiting request takes the freed slot
    assert [row.request_id for row in engine.running] == ids[1:]
    # every result before any solo run: a solo run resets the backends the engine shares
    results = [driver.result(request_id) for request_id in ids[1:]]
    assert not engine.has_work and target.num_rows == 0 and draft.num_rows == 0 and engine.abort(ids[0]) is None
    for result, prompt, cfg in zip(results, PROMPTS[1:3], MIXED[1:3]):
        assert result.token_ids == solo(target, draft, prompt, cfg).token_ids


def test_aborting_a_waiting_request_never_runs_it():
    target, draft = tables()
    engine = Engine(target, DraftModelProposer(draft), max_batch_size=1)
    a, b = engine.add(Request(PROMPTS[0], MIXED[0])), engine.add(Request(PROMPTS[1], MIXED[1]))
    assert engine.abort(b).token_ids == []
    while engine.has_work:
        engine.step()
    assert engine.abort(a) is None


def test_guard_adaptive_gamma_and_prompt_lookup_run_per_row_inside_a_batch():
    # A repetitive prompt gives lookup hits; a draft unlike the target with a high c makes the
    # guard pause; the adaptive schedule moves γ per row. Every row still equals its solo run.
    target, _ = tables()
    bad_draft = TableModel(8, seed=7, sharpness=4.0)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6], [7, 1, 7, 1, 7]]
    cfgs = [config(40, costs=(0.5, 0.0), gamma_schedule="adaptive", k=6),
            config(40, temperature=1.0, seed=9, costs=(0.5, 0.0), k=4),  # seeded: reproducible alone
            config(40, gamma_schedule="adaptive", k=8)]

    def proposer():
        return FallbackProposer(PromptLookupProposer(8), DraftModelProposer(bad_draft))

    batch = run_all(target, proposer(), [Request(p, c) for p, c in zip(prompts, cfgs)])
    for prompt, cfg, got in zip(prompts, cfgs, batch):
        alone = run(target, proposer(), prompt, cfg)
        assert got.token_ids == alone.token_ids
        assert (got.stats.num_drafted, got.stats.num_guard_pauses, got.stats.num_lookup_steps) == \
               (alone.stats.num_drafted, alone.stats.num_guard_pauses, alone.stats.num_lookup_steps)
    assert sum(r.stats.num_lookup_steps for r in batch) > 0
    assert batch[0].stats.num_guard_pauses > 0 and batch[2].stats.num_guard_pauses == 0
    fixed = run(target, proposer(), prompts[2], config(40, k=8))
    assert fixed.stats.num_drafted != batch[2].stats.num_drafted  # the schedule did move γ


class CheckedEngine(Engine):
    """After every step: each row's target cache holds its committed sequence minus the one pending
    token, and the draft's holds it minus its own pending tokens (docs/exactness.md rule 5)."""

    def step(self):
        outputs = super().step()
        draft = self.proposer.backend
        assert self.target.lengths == [len(row.tokens) - len(row.pending) for row in self.running]
        assert all(len(row.pending) == 1 for row in self.running)
        assert draft.lengths == [len(row.tokens) - len(state.pending)
                                 for row, state in zip(self.running, self.proposer.rows)]
        self.steps = getattr(self, "steps", 0) + 1
        return outputs


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_caches_hold_exactly_the_committed_prefix_after_every_step(device):
    target = HFCausalLM(tiny_llama(0).to(device), compact_min_dead=0, compact_ratio=0)
    draft = HFCausalLM(tiny_llama(1, layers=1).to(device))
    engine = CheckedEngine(target, DraftModelProposer(draft, 0.3), max_batch_size=3)
    driver = Driver(engine)
    prompts = [[5, 17, 33, 2], [9, 9, 41, 9, 9, 41], [70, 3], [11, 12, 13]]
    cfgs = [config(12), config(20, temperature=1.0, seed=4, k=4), config(8, k=2), config(10)]
    ids = [driver.submit(Request(p, c)) for p, c in zip(prompts, cfgs)]
    results = [driver.result(i) for i in ids]
    assert engine.steps > 5 and [len(r.token_ids) for r in results] == [12, 20, 8, 10]


def test_a_draft_with_a_smaller_embedding_table_gets_a_placeholder_for_ids_it_cannot_embed():
    # A target whose vocabulary is padded past the draft's table: prompt ids and target samples
    # beyond the draft's table must not crash the draft; output is still the target's greedy.
    target = HFCausalLM(tiny_llama(0, vocab=120))
    draft = HFCausalLM(tiny_llama(1, layers=1, vocab=96))
    prompt = [5, 17, 110, 2, 115, 40]
    spec = run(target, DraftModelProposer(draft), prompt, config(24))
    assert spec.token_ids == run(target, None, prompt, config(24)).token_ids


class TimedTable(TableModel):
    """A table model whose forward takes `per_token` seconds per token fed (padding included),
    plus `fixed`, on a FakeClock: a stand-in for a target whose wide verify steps cost more than
    plain ones, timed the same on a busy machine as on an idle one."""

    def __init__(self, *args, clock, per_token=0.0, fixed=0.0, **kw):
        super().__init__(*args, **kw)
        self.clock, self.per_token, self.fixed = clock, per_token, fixed

    def forward(self, feeds, num_logits):
        self.clock.advance(self.fixed + self.per_token * len(feeds) * max(len(f) for f in feeds))
        return super().forward(feeds, num_logits)


def run_timed(target, proposer, requests, clock):
    """run_all with the batch guard, every step timed on `clock`."""
    driver = Driver(Engine(target, proposer, batch_guard=True, clock=clock))
    ids = [driver.submit(request) for request in requests]
    return [driver.result(i) for i in ids]


def test_batch_cost_model_caps_gamma_where_the_batch_yields_most_tokens_per_second():
    from specdecode.engine.cost import BatchCostModel, LineFit, expected_tokens

    fit = LineFit()
    for x in (4, 36, 4, 36):
        fit.add(x, 0.01 + 0.002 * x)
    assert fit.predict(20) == pytest.approx(0.05)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(0.0, 8) == 1.0
    model = BatchCostModel(probe_every=3, max_probe_every=6)
    assert model.gamma_cap([8, 8, 8, 8], [None] * 4) == 8  # nothing timed yet: draft and measure
    for tokens, width, seconds in ((36, 9, 0.082), (36, 9, 0.082), (36, 9, 0.082)):
        model.observe_target(tokens, width, seconds)
    assert model.gamma_cap([8] * 4, [0.1] * 4) == 0       # a verify is timed: now time a plain step
    model.observe_target(4, 1, 0.018)                      # T(n) = 0.01 + 0.002 n
    model.observe_draft(8, 4, 0.016)                       # D = 2 ms
    # a poor draft: plain steps win; a probe (probe_gamma = 3 drafts) after 3 capped steps, then after 6
    caps, probes = zip(*[(model.gamma_cap([8] * 4, [0.1] * 4), model.probing) for _ in range(9)])
    assert caps == (0, 0, 3, 0, 0, 0, 0, 0, 3) and probes == (False, False, True) + (False,) * 5 + (True,)
    # otherwise the k with the most tokens per second, rate(k) = 4 E(α, k) / (T(4 (k + 1)) + k D),
    # if it beats plain steps by the 25% margin (α = 0.6: γ = 1 is best, but only by 3%)
    for alpha, best, gain in ((0.99, 8, 1.59), (0.95, 4, 1.40), (0.6, 1, 1.03)):
        rates = {k: 4 * expected_tokens(alpha, k) / (0.018 + 0.008 * k + 0.002 * k) for k in range(9)}
        assert max(rates, key=rates.get) == best and rates[best] / rates[0] == pytest.approx(gain, abs=0.05)
        assert model.gamma_cap([8] * 4, [alpha] * 4) == (best if gain > 1 + model.margin else 0)
    # rows keep their own plans below the cap: three rows planning 1 draft make a 9-wide verify for
    # the fourth row's 8 not worth it (rate 149 against 284 at γ = 1)
    model.capped_steps = 0  # not a probe step
    assert model.gamma_cap([8, 1, 1, 1], [0.99] * 4) == 1 and not model.probing


def test_the_batch_cost_model_spreads_a_rows_unread_prompt_over_its_remaining_steps():
    from specdecode.engine.cost import BatchCostModel

    model = BatchCostModel(probe_every=100)
    for _ in range(3):
        model.observe_target(36, 9, 0.082)
    model.observe_target(4, 1, 0.018)                      # T(n) = 0.01 + 0.002 n
    model.observe_draft(8, 4, 0.016)                       # D = 2 ms
    model.observe_read(100, 0.2)
    model.observe_read(300, 0.6)                           # R(u) = 2 ms per token
    # α = 0.95 and warm drafts: γ = 4 (as in the test above)
    assert model.gamma_cap([8] * 4, [0.95] * 4, [1] * 4, [100] * 4) == 4
    # four cold rows of 50-token prompts: their reads (0.1 s each) spread over 1000 tokens to go
    # leave γ = 4 the best (rate 305 against 222 for plain steps); over 10 tokens they do not pay
    assert model.gamma_cap([8] * 4, [0.95] * 4, [50] * 4, [1000] * 4) == 4
    assert model.gamma_cap([8] * 4, [0.95] * 4, [50] * 4, [10] * 4) == 0


def _guarded(n=40, k=6):
    return config(n, k=k, costs=(0.0, 0.0))


def test_the_batch_guard_caps_drafting_when_wide_steps_cost_more_than_they_yield_and_output_is_unchanged():
    clock = FakeClock()
    target = TimedTable(8, seed=0, sharpness=1.0, per_token=0.002, clock=clock)
    bad_draft = TableModel(8, seed=7, sharpness=4.0)
    prompts = [[1, 2, 3], [4, 5], [6, 1], [2, 2, 7]]
    batch = run_timed(target, DraftModelProposer(bad_draft, clock=clock), [Request(p, _guarded()) for p in prompts],
                      clock)
    assert sum(r.stats.num_batch_caps for r in batch) > 0
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == run(target, None, prompt, _guarded()).token_ids  # greedy: the target's own


def test_a_capped_batch_probes_with_one_row_so_only_that_row_reads_its_prompt_into_the_draft():
    clock = FakeClock()
    target = TimedTable(8, seed=0, sharpness=1.0, per_token=0.002, clock=clock)
    proposer = DraftModelProposer(TableModel(8, seed=7, sharpness=4.0), clock=clock)
    seen = []
    propose = proposer.propose
    proposer.propose = lambda rows, ks: seen.append(list(ks)) or propose(rows, ks)
    prompts = [[1, 2, 3], [4, 5], [6, 1], [2, 2, 7]]
    engine = Engine(target, proposer, None, None, batch_guard=True, clock=clock)
    engine.cost.min_probe_every = engine.cost.probe_every = 2
    driver = Driver(engine)
    ids = [driver.submit(Request(p, _guarded(60))) for p in prompts]
    [driver.result(i) for i in ids]
    capped = [ks for ks in seen[4:] if len(ks) == 4]  # after the first verify steps and the plain one
    probes = [ks for ks in capped if any(ks)]
    assert probes and all(sum(k > 0 for k in ks) == 1 and max(ks) <= 3 for ks in probes)
    assert len({ks.index(max(ks)) for ks in probes}) > 1  # the row that has drafted least probes next


def test_the_batch_guard_keeps_drafting_when_verifying_is_as_cheap_as_a_plain_step():
    clock = FakeClock()
    target = TimedTable(8, seed=0, sharpness=1.0, fixed=0.004, clock=clock)
    same = TableModel(8, seed=0, sharpness=1.0)  # the target itself: every draft accepted
    prompts = [[1, 2, 3], [4, 5], [6, 1]]
    batch = run_timed(target, DraftModelProposer(same, clock=clock), [Request(p, _guarded()) for p in prompts], clock)
    # one plain step times that kind of step; after it, drafting always pays here
    assert all(r.stats.num_batch_caps <= 1 and r.stats.mean_tokens_per_call > 4 for r in batch)


def test_a_guard_whose_costs_were_measured_under_a_load_spike_recovers_from_the_loops_own_timings():
    # c measured at start-up during a spike: 5 target calls per draft forward, where a draft forward
    # really costs 1/20 of a target call and the draft is the target itself (every draft accepted).
    # With the start-up c alone the guard would pause drafting for the whole run.
    clock = FakeClock()
    target = TimedTable(8, seed=0, sharpness=1.0, fixed=0.01, clock=clock)
    draft = TimedTable(8, seed=0, sharpness=1.0, fixed=0.0005, clock=clock)
    cfg = config(120, k=4, costs=(5.0, 0.0))
    [got] = run_timed(target, DraftModelProposer(draft, clock=clock), [Request([1, 2, 3], cfg)], clock)
    # one pause (16 plain steps) times a plain step; every step after it drafts: 120 tokens in ~40
    # calls, where a guard stuck on the start-up c pauses after every probe (~1.4 tokens per call)
    assert got.stats.num_guard_pauses == 1 and got.stats.mean_tokens_per_call > 2.5
    assert got.token_ids == run(target, None, [1, 2, 3], cfg).token_ids
    # and a guard whose start-up c was right still pauses a draft that does not pay
    slow_draft = TimedTable(8, seed=7, sharpness=4.0, fixed=0.008, clock=clock)
    [paused] = run_timed(target, DraftModelProposer(slow_draft, clock=clock),
                         [Request([1, 2, 3], config(60, k=4, costs=(0.8, 0.0)))], clock)
    assert paused.stats.num_guard_pauses >= 2


def test_step_timings_and_wall_time_are_read_from_the_engines_clock():
    clock = FakeClock()
    target = TimedTable(8, seed=0, sharpness=1.0, fixed=0.01, clock=clock)
    draft = TimedTable(8, seed=5, sharpness=1.0, fixed=0.002, clock=clock)
    driver = Driver(Engine(target, DraftModelProposer(draft, clock=clock), clock=clock))
    result = driver.result(driver.submit(Request([1, 2, 3], config(30, k=3))))
    stats = result.stats
    # every second the clock moved was a target forward or a draft forward, and nothing else counts
    assert stats.time_target_s == pytest.approx(0.01 * stats.num_target_calls)
    assert stats.time_draft_s == pytest.approx(0.002 * stats.num_draft_calls) and stats.num_draft_calls > 0
    assert stats.wall_time_s == pytest.approx(clock.now)


def test_a_backend_whose_rows_all_roll_back_to_empty_can_drop_a_row_and_read_again():
    # Rows whose draft caches are all empty (none has drafted yet: lazy prompt reads) are cropped
    # to 0 slots; dropping one of them then must not leave the other's batch size in the cache.
    backend = HFCausalLM(tiny_llama(1, layers=1))
    backend.add_row()
    backend.add_row()
    backend.forward([[5, 6], [7]], 1)
    backend.truncate([0, 0])
    backend.select([1])
    backend.forward([[9, 10, 11]], 1)
    assert backend.lengths == [3]
    backend.add_row(prefix_ids=[3, 4])
    assert backend.forward([[12], [5]], 1).shape[:2] == (2, 1) and backend.lengths == [4, 3]


def test_first_step_plain_gives_the_first_token_from_the_prompt_read_alone_and_the_same_greedy_text():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=0)
    config = DecodeConfig(max_new_tokens=30, sampling=SamplingParams(temperature=0), num_speculative_tokens=4)
    results = {}
    for plain_first in (False, True):
        engine = Engine(target, FallbackProposer(PromptLookupProposer(8), DraftModelProposer(draft)),
                        first_step_plain=plain_first)
        engine.add(Request([1, 2, 3, 1, 2], config))
        first = engine.step()[0]
        results[plain_first] = first
        while engine.has_work:
            for output in engine.step():
                if output.result is not None:
                    results[plain_first, "result"] = output.result
    assert results[True].num_drafted == 0 and len(results[True].events) == 1  # the target's token alone
    assert results[False].num_drafted > 0  # the default drafts with the prompt read
    assert results[True, "result"].token_ids == results[False, "result"].token_ids
