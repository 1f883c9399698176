"""verification="drafter-invariant": every token is the target's exponential race over its adjusted
distribution with noise keyed by the request's seed and the token's position, and drafts are kept
where they equal it. The race samples p exactly (chi-square, with a power check); the loop then
emits exactly what plain decoding emits with the same seed, whatever was drafted (tables, tiny
models in float32 and on the batch-invariant bfloat16 kernels), where the paper's rule does not
(the negative control); and the loop's sequences follow the target's distribution."""

import dataclasses

import pytest
import torch

from helpers import PROMPT, chi2_pvalue, loop_sequence_counts, tiny_llama
from specdecode import native
from specdecode.config import DecoderConfig
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams, race, race_noise
from specdecode.verify import drafter_invariant_step


def test_race_noise_is_a_function_of_seed_position_and_index():
    long = race_noise(7, 3, 1000)
    assert torch.equal(race_noise(7, 3, 1000), long)
    assert torch.equal(race_noise(7, 3, 97), long[:97])  # a smaller vocabulary sees the same numbers
    assert not torch.equal(race_noise(7, 4, 1000), long) and not torch.equal(race_noise(8, 3, 1000), long)
    assert torch.equal(race_noise(-1, 3, 10), race_noise(2**64 - 1, 3, 10))  # seeds are taken mod 2**64
    assert long.dtype == torch.float32 and (long > 0).all() and torch.isfinite(long).all()
    assert abs(float(long.mean()) - 1) < 0.1  # Exp(1)


P = torch.tensor([0.42, 0.0, 0.25, 0.18, 0.1, 0.05])


def race_counts(rule) -> list[int]:
    """How often each id wins over positions 0..5999 of seed 11."""
    counts = [0] * len(P)
    for position in range(6000):
        counts[int(rule(P, race_noise(11, position, len(P))))] += 1
    return counts


def test_the_race_samples_p_chi_square_and_the_test_has_power():
    # 6000 positions, significance 1e-3; a race on p + E instead of p / E fails it
    assert chi2_pvalue(race_counts(race), P) > 1e-3
    assert chi2_pvalue(race_counts(lambda p, e: (p + e).argmax()), P) < 1e-6


def test_step_keeps_the_drafts_equal_to_the_race_and_emits_its_winner():
    probs = torch.softmax(torch.randn(1, 4, 50, generator=torch.Generator().manual_seed(0)), -1)
    noise = torch.stack([race_noise(5, t, 60) for t in range(4)])[None]
    winners = race(probs, noise)[0]
    for n in range(4):
        drafts = winners[:3].clone()
        if n < 3:
            drafts[n] = (drafts[n] + 1) % 50
        kept, token = drafter_invariant_step(drafts[None], probs, noise)
        assert (int(kept), int(token)) == (n, int(winners[n]))
    with pytest.raises(ValueError, match="noise"):
        drafter_invariant_step(winners[None, :3], probs, noise[..., :40])


def tables():
    return TableModel(6, order=2, seed=20, sharpness=1.5), TableModel(6, order=2, seed=21, sharpness=1.5)


def sampled(seed, verification, k=4, tokens=20, temperature=1.0, top_p=1.0):
    return DecodeConfig(max_new_tokens=tokens, sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
                        num_speculative_tokens=k, verification=verification)


@pytest.mark.parametrize("make_proposer", [
    lambda d: DraftModelProposer(d),
    lambda d: DraftModelProposer(d, confidence_threshold=0.5),
    lambda d: FallbackProposer(PromptLookupProposer(6, max_ngram=2, min_ngram=1), DraftModelProposer(d)),
], ids=["draft", "confidence-stop", "lookup+draft"])
def test_speculative_equals_plain_for_every_seed_on_tables(make_proposer):
    target, draft = tables()
    differ = accepted = 0
    for seed in range(40):
        plain = run(target, None, [1, 2], sampled(seed, "drafter-invariant", k=0))
        spec = run(target, make_proposer(draft), [1, 2], sampled(seed, "drafter-invariant"))
        assert spec.token_ids == plain.token_ids, seed
        accepted += spec.stats.num_accepted
        # the paper's rule with the same seeds: the same distribution, other tokens (negative control)
        differ += run(target, make_proposer(draft), [1, 2], sampled(seed, "token")).token_ids != plain.token_ids
    assert accepted > 200 and differ > 30


def test_each_row_of_a_batch_is_its_plain_decoding():
    """Rows of one batch (other seeds, prompts and lengths, a paper's-rule row and a greedy row
    beside them) each emit what plain decoding of that request alone emits."""
    from specdecode.engine.driver import run_all
    from specdecode.engine.request import Request

    target, draft = tables()
    requests = [Request([1 + seed % 5, 2], sampled(seed, "drafter-invariant", tokens=12 + seed)) for seed in range(6)]
    others = [Request([3], sampled(99, "token")), Request([4, 1], sampled(None, "token", temperature=0))]
    batch = run_all(target, DraftModelProposer(draft), requests[:3] + others + requests[3:])
    mine = batch[:3] + batch[5:]
    for request, result in zip(requests, mine):
        alone = run(target, None, request.prompt_ids, dataclasses.replace(request.config, num_speculative_tokens=0))
        assert result.token_ids == alone.token_ids
    assert sum(r.stats.num_accepted for r in mine) > 10


def test_filters_and_draft_settings_do_not_change_the_tokens():
    target, draft = tables()
    for seed in range(10):
        plain = run(target, None, [3], sampled(seed, "drafter-invariant", k=0, temperature=0.7, top_p=0.9))
        for k in (1, 3, 6):
            spec = run(target, DraftModelProposer(draft), [3],
                       sampled(seed, "drafter-invariant", k=k, temperature=0.7, top_p=0.9))
            assert spec.token_ids == plain.token_ids


def test_a_shared_noise_draft_is_accepted_more_often_than_an_independent_one():
    # the draft races with the target's noise: agreement where p and q are close; drafting with
    # its own generator instead (what a cross-vocabulary draft does) agrees only by chance. A draft
    # near the target (the same table, softer): the paper's rule keeps 0.74 of its drafts, the
    # shared race 0.72 (seeds 0..29)
    target, draft = tables()[0], TableModel(6, order=2, seed=20, sharpness=1.0)

    class OwnNoise(DraftModelProposer):
        def propose(self, rows, ks):
            for row in rows:
                row.race_seed += 1
            try:
                return super().propose(rows, ks)
            finally:
                for row in rows:
                    row.race_seed -= 1

    rates = {}
    for name, proposer in (("shared", DraftModelProposer), ("own", OwnNoise)):
        stats = [run(target, proposer(draft), [1, 2], sampled(seed, "drafter-invariant")).stats for seed in range(30)]
        rates[name] = sum(s.num_accepted for s in stats) / sum(s.num_drafted for s in stats)
    assert rates["shared"] > rates["own"] + 0.15, rates


def test_tiny_model_speculative_equals_plain_in_float32():
    target, draft = HFCausalLM(tiny_llama(0)), HFCausalLM(tiny_llama(1, layers=1))
    for seed in range(4):
        plain = run(target, None, PROMPT, sampled(seed, "drafter-invariant", k=0, tokens=30))
        spec = run(target, DraftModelProposer(draft), PROMPT, sampled(seed, "drafter-invariant", tokens=30))
        assert spec.token_ids == plain.token_ids


@pytest.mark.skipif(not native.available(), reason="no C++ compiler for specdecode.native")
def test_bfloat16_invariant_kernels_speculative_equals_plain():
    """On the batch-invariant kernels a verify's rows are a step's bits, so the race sees the same
    p: sampled speculative output equals plain output for every seed and prompt."""
    from test_invariant import MODELS, invariant_backend

    model = MODELS["qwen2"]()
    target, draft = invariant_backend(model), HFCausalLM(model, lean=True)
    for seed in range(5):
        prompt = [(7 * t + 13 * seed) % 96 for t in PROMPT]
        plain = run(target, None, prompt, sampled(seed, "drafter-invariant", k=0, tokens=60))
        spec = run(target, DraftModelProposer(draft), prompt, sampled(seed, "drafter-invariant", k=6, tokens=60))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_target_calls < 45


@pytest.mark.slow
def test_loop_matches_target_distribution_chi_square():
    # 3000 seeded runs (seeds 0..2999; k = 3, 3 tokens, vocab 4 → 64 sequences); significance 1e-3
    observed, probs = loop_sequence_counts(lambda d: DraftModelProposer(d), SamplingParams(), runs=3000,
                                           verification="drafter-invariant")
    assert chi2_pvalue(observed, probs) > 1e-3


def test_options_refuse_lenience_and_trees():
    with pytest.raises(ValueError, match="lenience 0.5"):
        DecodeConfig(max_new_tokens=4, sampling=SamplingParams(), lenience=0.5, verification="drafter-invariant")
    with pytest.raises(ValueError, match="lenience 0.5 .*'drafter-invariant'"):
        DecoderConfig(verification="drafter-invariant").check_lenience(0.5)
    with pytest.raises(ValueError, match="tree_width"):
        DecoderConfig(verification="drafter-invariant", tree_width=2).validate()


def test_greedy_is_unchanged():
    target, draft = tables()
    greedy = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0), num_speculative_tokens=3)
    token = run(target, DraftModelProposer(draft), [1], greedy)
    invariant = run(target, DraftModelProposer(draft), [1], dataclasses.replace(greedy, verification="drafter-invariant"))
    assert token.token_ids == invariant.token_ids
