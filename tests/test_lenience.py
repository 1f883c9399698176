"""Lenience (paper A.5): opt-in, LOSSY, bounded. Sampling: accept with min(1, p/(l·q)), so no
token exceeds p(x)/l. Greedy: keep a draft token with p(x) >= l·max p (the paper's typo fixed,
paper.md §6.5); l = 1 is the exact rule in both cases."""

from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run
from specdecode.engine.request import ACCEPTED, DecodeConfig
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams, adjust
from specdecode.verify import greedy_lenient_step, speculative_step

from helpers import chi2_pvalue, speculative_sequence_probs, target_sequence_probs, tiny_llama

VOCAB, K, LENGTH, PROMPT = 4, 3, 3, [1, 2]


def table_models():
    return (TableModel(VOCAB, order=2, seed=20, sharpness=1.5),
            TableModel(VOCAB, order=2, seed=21, sharpness=1.5))


def loop_counts(lenience, runs, sampling=SamplingParams()):
    """Counts of the first LENGTH tokens over `runs` seeded runs of the real decoding loop."""
    target, draft = table_models()
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=LENGTH, num_speculative_tokens=K, lenience=lenience,
                              sampling=SamplingParams(temperature=sampling.temperature, seed=seed))
        result = run(target, DraftModelProposer(draft), PROMPT, config)
        assert result.stats.lossy == (lenience < 1)
        counts[tuple(result.token_ids)] += 1
    return counts


@pytest.mark.parametrize("lenience", [1.0, 0.5, 0.2])
def test_lenient_sequence_distribution_is_bounded_by_p_over_l(lenience):
    # Exact enumeration of Algorithm 1 with the A.5 rule over every 3-token sequence: each token
    # is at most p/l given its prefix, so the first token is <= p(x)/l and a sequence <= p(s)/l^3.
    target, draft = table_models()
    params = SamplingParams()
    exact = target_sequence_probs(target, PROMPT, LENGTH, params)
    lenient = speculative_sequence_probs(target, draft, PROMPT, LENGTH, K, params, lenience)
    assert abs(sum(lenient.values()) - 1) < 1e-6
    for seq, prob in exact.items():
        assert lenient.get(seq, 0.0) <= prob / lenience ** LENGTH + 1e-6, seq
    for x in range(VOCAB):
        first = sum(v for s, v in lenient.items() if s[0] == x)
        assert first <= float(adjust(target.logits_for(PROMPT), params)[x]) / lenience + 1e-6
    distance = sum(abs(lenient.get(s, 0.0) - p) for s, p in exact.items())
    if lenience == 1.0:
        assert distance < 1e-6  # l = 1 is exactly the target's distribution
    else:
        assert distance > 0.02  # l < 1 really changes it (else the bound above proves nothing)


@pytest.mark.parametrize("lenience", [1.0, 0.2])
@pytest.mark.slow
def test_decoding_loop_follows_the_lenient_rule_chi_square(lenience):
    # 3000 seeded loop runs (vocab 4, k=3, 3 tokens → 64 sequences) against the exact enumeration
    # of the lenient rule, significance 1e-3. At l = 0.2 the same counts must also clearly FAIL
    # against the target's own distribution: the loop really applies lenience.
    target, draft = table_models()
    params = SamplingParams()
    counts = loop_counts(lenience, runs=3000)
    expected = speculative_sequence_probs(target, draft, PROMPT, LENGTH, K, params, lenience)
    exact = target_sequence_probs(target, PROMPT, LENGTH, params)
    seqs = sorted(exact)
    observed = [counts[s] for s in seqs]
    assert chi2_pvalue(observed, [expected.get(s, 0.0) for s in seqs]) > 1e-3
    p_vs_target = chi2_pvalue(observed, [exact[s] for s in seqs])
    if lenience == 1.0:
        assert p_vs_target > 1e-3
    else:
        assert p_vs_target < 1e-6


# --- greedy lenience (temperature 0) ---

def test_greedy_lenient_step_at_l1_is_plain_greedy_verification():
    # Integer logits in a small range make ties common: plain greedy keeps only the lowest id.
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k, vocab = 4, 5
        logits = torch.randint(0, 3, (1, k + 1, vocab), generator=g).float()
        drafts = torch.randint(0, vocab, (1, k), generator=g)
        q = torch.nn.functional.one_hot(drafts, vocab).float()
        p = adjust(logits, SamplingParams(temperature=0))
        expected = speculative_step(drafts, q, p)
        got = greedy_lenient_step(drafts, logits, 1.0)
        assert [int(t) for t in got] == [int(t) for t in expected], (logits, drafts)


def test_greedy_lenient_step_keeps_tokens_within_factor_l_of_the_top():
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    logits = probs.log()
    drafts = torch.tensor([[1, 2]])  # 0.3 / 0.5 = 0.6, then 0.3 / 0.6 = 0.5
    assert greedy_lenient_step(drafts, logits, 0.55) == (1, 1)  # second fails: argmax there is 1
    assert greedy_lenient_step(drafts, logits, 0.45) == (2, 2)  # both kept: bonus = argmax of row 2
    assert greedy_lenient_step(drafts, logits, 1.0) == (0, 0)
    assert greedy_lenient_step(torch.tensor([[7, 0]]), logits, 0.01) == (0, 0)  # out of vocab: rejected


@pytest.mark.parametrize("kwargs,match", [
    (dict(lenience=0.0), "lenience"), (dict(lenience=1.5), "lenience"),
    (dict(logits=torch.zeros(1, 2, 3)), r"\[B, k\+1, V\]"),
])
def test_greedy_lenient_step_rejects_bad_arguments(kwargs, match):
    logits = kwargs.get("logits", torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match=match):
        greedy_lenient_step(torch.zeros(1, 2, dtype=torch.long), logits, kwargs.get("lenience", 0.5))


def greedy_run(target, draft, lenience, k=K, n=12, prompt=PROMPT):
    config = DecodeConfig(max_new_tokens=n, num_speculative_tokens=k, lenience=lenience,
                          sampling=SamplingParams(temperature=0))
    return run(target, DraftModelProposer(draft) if draft is not None else None, prompt, config)


def test_greedy_lenience_bound_holds_for_every_accepted_token_in_the_loop():
    target, draft = TableModel(6, order=2, seed=3), TableModel(6, order=2, seed=4)
    for lenience in (0.5, 0.2, 0.05):
        result = greedy_run(target, draft, lenience, n=40)
        assert result.stats.lossy
        prefix = list(PROMPT)
        non_argmax_kept = 0
        for token, origin in zip(result.token_ids, result.origins):
            p = torch.softmax(target.logits_for(prefix), -1)
            if origin == ACCEPTED:
                assert p[token] >= lenience * p.max() * (1 - 1e-6), (lenience, prefix, token)
                non_argmax_kept += token != int(p.argmax())
            else:  # a correction or bonus token is the target's argmax
                assert token == int(p.argmax())
            prefix.append(token)
        if lenience <= 0.2:
            assert non_argmax_kept > 0, lenience  # lenience actually accepted a non-argmax token


def test_greedy_lenience_one_is_plain_greedy_token_for_token():
    target, draft = TableModel(6, order=2, seed=3), TableModel(6, order=2, seed=4)
    plain = greedy_run(target, None, 1.0, k=0, n=40)
    spec = greedy_run(target, draft, 1.0, n=40)
    assert spec.token_ids == plain.token_ids and not spec.stats.lossy
    assert greedy_run(target, draft, 0.05, n=40).token_ids != plain.token_ids  # the test can fail


def test_small_lenience_raises_acceptance_rate_on_a_tiny_transformer():
    target = tiny_llama(0)
    draft = tiny_llama(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    prompt = [5, 17, 33, 2, 71, 40, 8]
    alpha = {}
    for lenience in (1.0, 0.1):
        result = greedy_run(HFCausalLM(target), HFCausalLM(draft), lenience, k=4, n=48, prompt=prompt)
        alpha[lenience] = result.stats.acceptance_rate
    assert alpha[0.1] > alpha[1.0], alpha


# --- public API and CLI ---


def test_generate_lenience_is_opt_in_and_marks_results_lossy(model_dirs):
    from specdecode import SpeculativeDecoder

    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], num_speculative_tokens=3,
                                 dtype="float32")
    exact = decoder.generate("abc", max_new_tokens=8, sampling=SamplingParams(seed=0))
    lossy = decoder.generate("abc", max_new_tokens=8, sampling=SamplingParams(seed=0), lenience=0.5)
    greedy = decoder.generate(["abc", "ab"], max_new_tokens=8, sampling=SamplingParams(temperature=0), lenience=0.3)
    assert not exact.stats.lossy and exact.to_dict()["stats"]["lossy"] is False
    assert lossy.stats.lossy and lossy.to_dict()["stats"]["lossy"] is True
    assert all(r.stats.lossy for r in greedy)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5", None])
def test_generate_refuses_lenience_outside_0_1(model_dirs, bad):
    from specdecode import SpeculativeDecoder

    decoder = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    with pytest.raises(ValueError, match="lenience"):
        decoder.generate("abc", max_new_tokens=2, lenience=bad)


def test_cli_lenience_flag_reports_lossy_json(model_dirs, capsys):
    import json

    from specdecode.cli import main

    code = main(["generate", "abc", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                 "--temperature", "0", "--max-new-tokens", "6", "--dtype", "float32", "--json", "--quiet",
                 "--lenience", "0.5"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["stats"]["lossy"] is True


@pytest.mark.parametrize("value", ["0", "1.01", "-1", "nan"])
def test_cli_bad_lenience_exits_2_before_loading_models(value, capsys):
    from specdecode.cli import build_parser, main

    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(["generate", "hello", "--target", "./no/such/dir", "--lenience", value])
    assert exit_info.value.code == 2
    assert "--lenience" in capsys.readouterr().err
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "LOSSY" in help_text
