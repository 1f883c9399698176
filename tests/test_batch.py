"""Batched decoding (the engine with many rows): every row is exactly what it would be alone.

Table models have no floating-point batch effect, so rows are compared with single runs token
for token at any temperature, seeds included; tiny float32 Llamas are compared under greedy
decoding; a chi-square test checks the batched loop's distribution at temperature 1."""

from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run, run_all
from specdecode.engine.engine import Engine
from specdecode.engine.request import BONUS, CORRECTED, DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import sequence_pvalues, single_row_logits, tiny_llama, tiny_mistral

GREEDY = SamplingParams(temperature=0)
# Different lengths, limits, γ and seeds per row, so rows accept, stop and leave at different steps.
PROMPTS = [[1, 2], [3], [4, 5, 6, 7, 1], [2, 2, 2]]
LIMITS = [(20, 3), (7, 4), (30, 2), (15, 3)]


def row_configs(sampling, eos=frozenset({7}), limits=LIMITS, seed0=10):
    return [DecodeConfig(max_new_tokens=m, num_speculative_tokens=k, eos_token_ids=eos,
                         sampling=SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                                 seed=seed0 + i))
            for i, (m, k) in enumerate(limits)]


def table_pair_close(vocab=8, noise=1.0):
    """A target table and a draft that is the target plus noise: full and partial acceptance."""
    target, draft = TableModel(vocab, seed=0), TableModel(vocab, seed=0)
    draft.table = draft.table + noise * torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(5))
    return target, draft


def requests(prompts, configs):
    return [Request(prompt, config) for prompt, config in zip(prompts, configs)]


def stats_tuple(stats):
    return (stats.num_target_calls, stats.num_draft_calls, stats.num_drafted, stats.num_accepted,
            stats.accepted_per_position, stats.num_generated)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(), SamplingParams(top_p=0.7)], ids=["greedy", "t1", "topp"])
@pytest.mark.parametrize("confidence", [0.0, 0.5], ids=["fixed-gamma", "dynamic-gamma"])
def test_each_row_equals_its_single_run_token_for_token_with_its_own_seed(sampling, confidence):
    target, draft = table_pair_close()
    configs = row_configs(sampling)
    batch = run_all(target, DraftModelProposer(draft, confidence), requests(PROMPTS, configs))
    for prompt, config, got in zip(PROMPTS, configs, batch):
        alone = run(target, DraftModelProposer(draft, confidence), prompt, config)
        assert got.token_ids == alone.token_ids
        assert got.origins == alone.origins and got.finish_reason == alone.finish_reason
        assert stats_tuple(got.stats) == stats_tuple(alone.stats)
    # ragged for real: rows ended differently and some blocks were cut by rejections
    assert {r.finish_reason for r in batch} == {"eos", "length"}
    assert any(CORRECTED in r.origins for r in batch) and any(BONUS in r.origins for r in batch)


def test_a_rows_output_does_not_depend_on_its_neighbours():
    target, draft = TableModel(8, seed=0), TableModel(8, seed=5)
    config = DecodeConfig(max_new_tokens=25, sampling=SamplingParams(seed=42), num_speculative_tokens=3)
    outputs = []
    for neighbours in ([], [[5, 5, 5, 5, 5, 5]], [[1], [2, 3]]):
        others = [DecodeConfig(max_new_tokens=9, sampling=SamplingParams(seed=7 + i), num_speculative_tokens=2)
                  for i in range(len(neighbours))]
        result = run_all(target, DraftModelProposer(draft), requests(neighbours + [[1, 2]], others + [config]))
        outputs.append(result[-1].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_plain_batched_decoding_equals_plain_single_decoding():
    target = TableModel(8, seed=0)
    configs = row_configs(SamplingParams())
    batch = run_all(target, None, requests(PROMPTS, configs))
    for prompt, config, got in zip(PROMPTS, configs, batch):
        alone = run(target, None, prompt, config)
        assert got.token_ids == alone.token_ids and got.stats.num_target_calls == alone.stats.num_target_calls


def test_context_windows_clip_each_row_as_alone():
    target = TableModel(8, seed=0, max_length=12)
    draft = TableModel(8, seed=5, max_length=9)
    configs = row_configs(SamplingParams(), eos=frozenset())
    batch = run_all(target, DraftModelProposer(draft), requests(PROMPTS, configs))
    for prompt, config, got in zip(PROMPTS, configs, batch):
        alone = run(target, DraftModelProposer(draft), prompt, config)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert len(prompt) + len(got.token_ids) <= 12


class NoRollbackTable(TableModel):
    """A broken backend: rejected drafts stay in the context (what a wrong per-row cache does)."""

    def truncate(self, lengths):
        pass


def batched_sequence_counts(backend_class, batches=1000, vocab=4, k=3, length=3, lookup=False, stats=None):
    """Rows of ragged batches (three prompts, each row its own seed), counted per prompt; with
    lookup, prompt lookup drafts per row and the draft model serves the rows without a match."""
    target = backend_class(vocab, order=2, seed=20, sharpness=1.5)
    draft = backend_class(vocab, order=2, seed=21, sharpness=1.5)
    prompts = [[1, 2], [3], [0, 2, 1, 3]] if not lookup else [[1, 2, 1, 2], [3, 0, 3], [0, 2, 1, 3, 0, 2]]
    counts = [Counter() for _ in prompts]
    for run_index in range(batches):
        configs = [DecodeConfig(max_new_tokens=length, num_speculative_tokens=k,
                                sampling=SamplingParams(seed=3 * run_index + i)) for i in range(len(prompts))]
        proposer = DraftModelProposer(draft)
        if lookup:
            proposer = FallbackProposer(PromptLookupProposer(vocab), proposer)
        results = run_all(target, proposer, requests(prompts, configs))
        for i, result in enumerate(results):
            counts[i][tuple(result.token_ids)] += 1
            if stats is not None:
                stats.append(result.stats)
    return sequence_pvalues(target, prompts, counts, length)


def test_batched_loop_matches_target_distribution_chi_square():
    # 1000 ragged batches of 3 rows (k=3, 3 tokens, vocab 4 → 64 sequences per prompt), seeds
    # 0..2999; each prompt's test fails at significance 1e-3.
    assert min(batched_sequence_counts(TableModel)) > 1e-3


@pytest.mark.slow
def test_batched_loop_with_per_row_prompt_lookup_matches_target_distribution_chi_square():
    # The same test with prompt lookup choosing per row (repetitive prompts: lookup hits) and the
    # draft model batching the rest; 1000 batches, significance 1e-3 per prompt.
    stats = []
    assert min(batched_sequence_counts(TableModel, lookup=True, stats=stats)) > 1e-3
    assert sum(s.num_lookup_steps for s in stats) > 500 and sum(s.num_draft_calls for s in stats) > 500


def test_chi_square_detects_a_batch_that_does_not_roll_back_rejected_drafts():
    # 300 batches suffice: the broken batch's p-values are below 1e-100
    assert max(batched_sequence_counts(NoRollbackTable, batches=300)) < 1e-6


def test_an_empty_prompt_and_a_batch_size_below_one_are_refused():
    target = TableModel(4)
    with pytest.raises(ValueError, match="at least one token"):
        run_all(target, None, requests([[1], []], row_configs(GREEDY)[:2]))
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        Engine(target, None, max_batch_size=0)


def test_max_batch_size_queues_requests_and_each_still_equals_its_single_run():
    target, draft = table_pair_close()
    configs = row_configs(SamplingParams())
    engine = Engine(target, DraftModelProposer(draft), max_batch_size=2)
    ids = [engine.add(request) for request in requests(PROMPTS, configs)]
    results, widest = {}, 0
    while engine.has_work:
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result
        widest = max(widest, len(engine.running), target.num_rows)
    assert widest == 2
    for request_id, prompt, config in zip(ids, PROMPTS, configs):
        assert results[request_id].token_ids == run(target, DraftModelProposer(draft), prompt, config).token_ids


# --- tiny float32 Llamas -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_llama(0)
    draft = tiny_llama(0)  # the target plus noise: agrees often, not always
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.005 * torch.randn_like(param))
    return target, draft


LLAMA_PROMPTS = [[5, 17, 33, 2, 71, 40, 8], [9, 3], [60, 61, 62, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [44]]


@pytest.mark.parametrize("k,confidence,compact", [(3, 0.0, False), (6, 0.3, False), (4, 0.0, True)],
                         ids=["k3", "k6-dynamic", "k4-compact-always"])
def test_batched_greedy_equals_single_greedy_on_tiny_llamas(llama_pair, k, confidence, compact, monkeypatch):
    target, draft = llama_pair
    compactions = []
    real_compact = HFCausalLM._compact
    monkeypatch.setattr(HFCausalLM, "_compact", lambda self: compactions.append(1) or real_compact(self))
    configs = [DecodeConfig(max_new_tokens=n, sampling=GREEDY, num_speculative_tokens=k) for n in (40, 25, 40, 33)]
    policy = dict(compact_min_dead=0, compact_ratio=0) if compact else {}  # always, or the default policy
    batch = run_all(HFCausalLM(target, **policy), DraftModelProposer(HFCausalLM(draft, **policy), confidence),
                    requests(LLAMA_PROMPTS, configs))
    batch_compactions = len(compactions)
    for prompt, config, got in zip(LLAMA_PROMPTS, configs, batch):
        plain = run(HFCausalLM(target), None, prompt, DecodeConfig(max_new_tokens=config.max_new_tokens,
                                                                    sampling=GREEDY))
        assert got.token_ids == plain.token_ids
        assert 0 < got.stats.num_accepted < got.stats.num_drafted
    assert (batch_compactions > 5) == compact


def test_plain_batched_greedy_equals_single_greedy_on_a_tiny_llama(llama_pair):
    target, _ = llama_pair
    configs = [DecodeConfig(max_new_tokens=20, sampling=GREEDY) for _ in LLAMA_PROMPTS]
    batch = run_all(HFCausalLM(target), None, requests(LLAMA_PROMPTS, configs))
    for prompt, config, got in zip(LLAMA_PROMPTS, configs, batch):
        assert got.token_ids == run(HFCausalLM(target), None, prompt, config).token_ids


def test_batched_backend_matches_single_backend_logits_after_ragged_rollbacks(llama_pair):
    target, _ = llama_pair
    backend = HFCausalLM(target, compact_min_dead=0, compact_ratio=0)
    for _ in range(3):
        backend.add_row()
    backend.forward([[5, 17, 33], [1, 2, 3, 4, 5, 6, 7, 8], [9]], 1)
    backend.forward([[1, 2, 3], [4], [5, 6]], 3)
    backend.truncate([4, 9, 2])       # row 0 keeps one draft, row 1 all, row 2 none
    assert backend.lengths == [4, 9, 2]
    assert backend.valid.sum(1).tolist() == [4, 9, 2] and backend.num_slots == 9  # compacted
    logits = backend.forward([[7], [8], [9, 10]], 1)[:, 0]
    for b, sequence in enumerate([[5, 17, 33, 1, 7], [1, 2, 3, 4, 5, 6, 7, 8, 4, 8], [9, 5, 9, 10]]):
        alone = single_row_logits(HFCausalLM(target), sequence, 1)[0]
        assert torch.allclose(logits[b], alone, atol=1e-5)
    for layer in backend.cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_finished_rows_leave_the_batch(llama_pair):
    target, _ = llama_pair
    backend = HFCausalLM(target)
    engine = Engine(backend)
    ids = [engine.add(Request(prompt, DecodeConfig(max_new_tokens=n, sampling=GREEDY)))
           for prompt, n in zip(LLAMA_PROMPTS[:2], (2, 12))]
    finished = []
    while not finished:
        finished = [output.request_id for output in engine.step() if output.result is not None]
    assert finished == ids[:1] and [row.request_id for row in engine.running] == ids[1:]
    assert backend.num_rows == 1 and backend.cache.layers[0].keys.shape[0] == 1
    while engine.has_work:
        engine.step()
    assert backend.num_rows == 0


def test_a_sliding_window_model_holds_one_row_and_the_engine_queues_the_others():
    target, draft = HFCausalLM(tiny_mistral(0, 2)), HFCausalLM(tiny_mistral(1, 1))
    assert target.max_rows == 1
    target.add_row()
    with pytest.raises(ValueError, match="sliding-window attention: one row at a time"):
        target.add_row()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    configs = [DecodeConfig(max_new_tokens=20, sampling=GREEDY, num_speculative_tokens=3)] * 3
    batch = run_all(target, DraftModelProposer(draft), requests(prompts, configs))
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == run(target, None, prompt, DecodeConfig(max_new_tokens=20, sampling=GREEDY)).token_ids
        assert got.stats.num_drafted > 0


# --- throughput (specdecode.measure.batch_bench) ---------------------------------------------------------

def test_batch_throughput_reports_sane_rows_for_tables_and_tiny_llamas(llama_pair):
    from specdecode.measure.batch_bench import batch_throughput

    target, draft = table_pair_close()
    for target_backend, draft_backend, prompts in ((target, draft, PROMPTS),
                                                   (HFCausalLM(llama_pair[0]), HFCausalLM(llama_pair[1]),
                                                    LLAMA_PROMPTS)):
        rows = batch_throughput(target_backend, draft_backend, prompts, [1, 3], new_tokens=8, gamma=3,
                                sampling=SamplingParams(seed=0))
        assert [(r["batch_size"], r["method"]) for r in rows] == [(1, "plain"), (1, "speculative"),
                                                                   (3, "plain"), (3, "speculative")]
        for r in rows:
            assert r["num_tokens"] == 8 * r["batch_size"]  # EOS ignored: every row runs to the limit
            assert r["tokens_per_second"] > 0 and 0 < r["mean_latency_s"] <= r["wall_time_s"] * 1.01
            assert r["speedup"] > 0
        plain, spec = rows[0], rows[1]
        assert plain["mean_tokens_per_call"] == 1.0 and plain["acceptance_rate"] is None and plain["gamma"] == 0
        assert spec["mean_tokens_per_call"] > 1.0 and 0 < spec["acceptance_rate"] <= 1


@pytest.mark.parametrize("kwargs,match", [(dict(batch_sizes=[0]), "batch_sizes"), (dict(prompt_ids=[[]]), "prompt_ids"),
                                          (dict(gamma=0), "gamma")])
def test_batch_throughput_rejects_bad_arguments(kwargs, match):
    from specdecode.measure.batch_bench import batch_throughput

    args = dict(target_backend=TableModel(4), draft_backend=None, prompt_ids=[[1]], batch_sizes=[1],
                new_tokens=2, gamma=2, sampling=GREEDY) | kwargs
    with pytest.raises(ValueError, match=match):
        batch_throughput(**args)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams()], ids=["greedy", "t1"])
def test_lenient_rows_equal_their_lenient_single_runs(sampling):
    # Every row goes through engine.accept with its own config, the greedy lenience rule
    # included (paper A.5, lossy).
    import dataclasses

    target, draft = table_pair_close(noise=2.0)
    configs = [dataclasses.replace(c, lenience=0.3) for c in row_configs(sampling)]
    batch = run_all(target, DraftModelProposer(draft), requests(PROMPTS, configs))
    for prompt, config, got in zip(PROMPTS, configs, batch):
        alone = run(target, DraftModelProposer(draft), prompt, config)
        assert got.token_ids == alone.token_ids and got.stats.lossy and alone.stats.lossy
