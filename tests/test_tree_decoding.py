"""The engine with token trees from the draft model: the loop still samples the target exactly,
greedy output is plain greedy's, and the caches stay right when a side branch wins."""

import pytest

from specdecode.engine.driver import run, run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams

from helpers import PROMPT, chi2_pvalue, loop_sequence_counts, tiny_llama

GREEDY = SamplingParams(temperature=0)


class WrongSiblingQ(DraftModelProposer):
    """A broken tree proposer: reports the chain token's q for its siblings, which were drawn
    without replacement (so from another q)."""

    def propose(self, rows, ks):
        import dataclasses

        drafts = super().propose(rows, ks)
        out = []
        for d in drafts:
            if d.parents is None or len(d.tokens) == len(d.chain):
                out.append(d)
                continue
            probs = d.probs.clone()
            for i, parent in enumerate(d.parents):
                if i not in d.chain:
                    probs[i] = probs[next(c for c in d.chain if d.parents[c] == parent)]
            out.append(dataclasses.replace(d, probs=probs))
        return out


@pytest.mark.parametrize("params,make_proposer", [
    (SamplingParams(), lambda d: DraftModelProposer(d, tree_width=2, tree_confidence=1.0)),
    pytest.param(SamplingParams(top_k=3), lambda d: DraftModelProposer(d, tree_width=3, tree_confidence=0.7),
                 marks=pytest.mark.slow),
    pytest.param(SamplingParams(), lambda d: FallbackProposer(PromptLookupProposer(
        4, max_ngram=2, min_ngram=1), DraftModelProposer(d, 0.5, tree_width=2, tree_confidence=1.0)),
        marks=pytest.mark.slow),
], ids=["width2-everywhere", "width3-uncertain-topk3", "lookup+tree-confidence-stop"])
@pytest.mark.slow
def test_tree_loop_matches_target_distribution_chi_square(params, make_proposer):
    # 3000 seeded runs (seeds 0..2999), k=3, 3 tokens, vocab 4 → 64 sequences; significance 1e-3.
    observed, probs = loop_sequence_counts(make_proposer, params, runs=3000)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.slow
def test_tree_chi_square_detects_siblings_reported_with_the_wrong_q():
    # Power: the same test rejects a proposer whose siblings carry the chain token's q.
    observed, probs = loop_sequence_counts(lambda d: WrongSiblingQ(d, tree_width=3, tree_confidence=1.0),
                                           SamplingParams(), runs=3000)
    assert chi2_pvalue(observed, probs) < 1e-6


def test_trees_accept_more_per_call_than_chains_on_tables():
    target, draft = TableModel(6, order=2, seed=20, sharpness=1.5), TableModel(6, order=2, seed=21, sharpness=1.5)
    rate = {}
    for width in (1, 3):
        accepted = calls = wins = 0
        for seed in range(40):
            config = DecodeConfig(max_new_tokens=16, sampling=SamplingParams(seed=seed), num_speculative_tokens=3)
            stats = run(target, DraftModelProposer(draft, tree_width=width, tree_confidence=1.0), [1, 2], config).stats
            accepted, calls, wins = accepted + stats.num_accepted, calls + stats.num_target_calls, \
                wins + stats.num_tree_branch_wins
        rate[width] = (accepted / calls, wins)
    assert rate[1][1] == 0 and rate[3][1] > 20
    assert rate[3][0] > rate[1][0] * 1.1, rate


@pytest.fixture(scope="module")
def llama_pair():
    return tiny_llama(0), tiny_llama(1, layers=1)


@pytest.mark.parametrize("width,confidence", [(2, 1.0), (4, 0.9)])
def test_tree_greedy_equals_plain_greedy_and_side_branches_win(llama_pair, width, confidence):
    # float32 tiny Llamas: token for token plain greedy, while side branches do win (so the
    # target's cache, holding only the winning path, is exercised) and the caches stay exact.
    target_model, draft_model = llama_pair
    plain = run(HFCausalLM(target_model), None, PROMPT, DecodeConfig(max_new_tokens=24, sampling=GREEDY))
    target = HFCausalLM(target_model)
    proposer = DraftModelProposer(HFCausalLM(draft_model), tree_width=width, tree_confidence=confidence)
    config = DecodeConfig(max_new_tokens=24, sampling=GREEDY, num_speculative_tokens=4)
    result = run(target, proposer, PROMPT, config)
    assert result.token_ids == plain.token_ids
    assert result.stats.num_tree_branch_wins > 0


def test_tree_rows_in_a_batch_equal_their_single_runs(llama_pair):
    target_model, draft_model = llama_pair
    prompts = [PROMPT, [3, 9, 27], [50, 51, 52, 53, 54, 55, 56, 57, 58]]
    configs = [DecodeConfig(max_new_tokens=m, sampling=GREEDY, num_speculative_tokens=k)
               for m, k in ((20, 4), (12, 2), (16, 3))]

    def proposer():
        return DraftModelProposer(HFCausalLM(draft_model), tree_width=3, tree_confidence=1.0)

    batch = run_all(HFCausalLM(target_model), proposer(),
                    [Request(p, c) for p, c in zip(prompts, configs)])
    for prompt, config, got in zip(prompts, configs, batch):
        alone = run(HFCausalLM(target_model), None, prompt, DecodeConfig(max_new_tokens=config.max_new_tokens,
                                                                          sampling=GREEDY))
        assert got.token_ids == alone.token_ids


def test_cache_lengths_equal_committed_lengths_after_every_tree_step(llama_pair):
    # After each step the target holds the committed prefix minus the pending token, the draft
    # its committed prefix minus its pending tokens: nothing of a losing branch stays.
    from specdecode.engine.engine import Engine

    target_model, draft_model = llama_pair
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    proposer = DraftModelProposer(draft, tree_width=3, tree_confidence=1.0)
    engine = Engine(target, proposer)
    engine.add(Request(PROMPT, DecodeConfig(max_new_tokens=30, sampling=SamplingParams(seed=2),
                                            num_speculative_tokens=3)))
    while engine.has_work:
        engine.step()
        for row, state in zip(engine.running, proposer.rows):
            assert target.lengths[0] == len(row.tokens) - 1
            assert draft.lengths[0] == len(row.tokens) - len(state.pending)


def test_tree_width_and_confidence_are_checked():
    with pytest.raises(ValueError, match="tree_width"):
        DraftModelProposer(TableModel(4), tree_width=0)
    with pytest.raises(ValueError, match="tree_confidence"):
        DraftModelProposer(TableModel(4), tree_width=2, tree_confidence=0.0)


# --- the public switches ----------------------------------------------------------------------------

def test_decoder_with_trees_greedy_equals_plain_and_refuses_lossy_or_block(model_dirs):
    from specdecode import SpeculativeDecoder

    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    tree = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], num_speculative_tokens=3, dtype="float32",
                              tree_width=3, tree_confidence=1.0, guard=False)
    assert tree.generate("abcab", max_new_tokens=20, sampling=GREEDY).token_ids == \
        plain.generate("abcab", max_new_tokens=20, sampling=GREEDY).token_ids
    first = tree.generate("abc", max_new_tokens=12, sampling=SamplingParams(seed=4))
    assert tree.generate("abc", max_new_tokens=12, sampling=SamplingParams(seed=4)).token_ids == first.token_ids
    with pytest.raises(ValueError, match="tree_width=1"):
        tree.generate("abc", max_new_tokens=4, lenience=0.5)
    for kwargs, match in ((dict(tree_width=2, verification="block"), "verification='token'"),
                          (dict(tree_width=0), "tree_width"), (dict(tree_confidence=0), "tree_confidence")):
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(model_dirs["target"], None, **kwargs)


@pytest.mark.parametrize("args,message", [
    (["--tree-width", "0"], "--tree-width must be an integer >= 1"),
    (["--tree-width", "2", "--verification", "block"], "--tree-width > 1 needs --verification token"),
    (["--tree-width", "2", "--lenience", "0.5"], "(lossy) needs --tree-width 1"),
    (["--tree-confidence", "1.5"], "--tree-confidence must be in (0, 1]"),
])
def test_cli_tree_errors_exit_2_with_one_line(args, message, capsys):
    from specdecode.cli import main

    with pytest.raises(SystemExit, match="^2$"):
        main(["generate", "hi"] + args)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def test_cli_generate_with_a_tree(model_dirs, capsys):
    import json

    from specdecode.cli import main

    assert main(["generate", "abc", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                 "--tree-width", "3", "--tree-confidence", "1", "--temperature", "0", "--max-new-tokens", "10",
                 "--dtype", "float32", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 10 and "num_tree_branch_wins" in out["stats"]
