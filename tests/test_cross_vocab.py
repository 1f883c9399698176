"""Drafts with another tokenizer (TLI and SLEM, Timor et al. 2025): the shared vocabulary, TLI's
q and one step by enumeration, a chi-square test of TLI's sampled distribution through the batched engine with two table models
whose vocabularies differ (shared and unshared strings) and a negative control that fails it,
greedy equality with plain decoding for SLEM and TLI on tiny Llamas, and the refusal of a pair
that shares too little."""

from collections import Counter

import pytest
import torch

from specdecode.engine.driver import run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM, TableModel
from specdecode.proposers.base import Draft
from specdecode.proposers.cross_vocab import CrossVocabProposer, shared_vocabulary
from specdecode.sampling import SamplingParams

from helpers import sequence_pvalues, tiny_llama


def char_tokenizer(vocab: dict[str, int]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="?")


# the target writes a b c d; the draft knows b c d (other ids), e and x (unshared), and ? (unknown)
TARGET_TOK = char_tokenizer({"a": 0, "b": 1, "c": 2, "d": 3, "?": 4})
DRAFT_TOK = char_tokenizer({"x": 0, "d": 1, "c": 2, "b": 3, "e": 4, "?": 5})


def test_the_shared_vocabulary_maps_equal_strings_one_to_one():
    to_target = shared_vocabulary(TARGET_TOK, DRAFT_TOK, 6, 5)
    assert to_target.tolist() == [-1, 3, 2, 1, -1, 4]


class HalfQ(CrossVocabProposer):
    """A broken TLI: the q it reports is half the restricted distribution it sampled from."""

    def _to_target(self, draft, k, slem):
        d = super()._to_target(draft, k, slem)
        return Draft(d.tokens, d.probs * 0.5, d.forwards)


def tli_pvalues(proposer_class, batches):
    vocab, length = 5, 3
    target = TableModel(vocab, order=2, seed=20, sharpness=1.5)
    draft = TableModel(6, order=2, seed=21, sharpness=1.5)
    prompts = [[1, 2], [0, 3, 1], [3]]
    counts = [Counter() for _ in prompts]
    for run_index in range(batches):
        proposer = proposer_class(draft, DRAFT_TOK, TARGET_TOK, vocab, method="tli", min_shared=3)
        configs = [DecodeConfig(length, SamplingParams(seed=3 * run_index + i), num_speculative_tokens=3)
                   for i in range(len(prompts))]
        for i, result in enumerate(run_all(target, proposer, [Request(p, c) for p, c in zip(prompts, configs)],
                                           tokenizer=TARGET_TOK)):
            counts[i][tuple(result.token_ids)] += 1
    return sequence_pvalues(target, prompts, counts, length)


@pytest.mark.slow
def test_tli_with_a_foreign_vocabulary_matches_the_target_distribution_chi_square():
    # 1500 batches of 3 rows (vocab 5, 3 tokens: 125 sequences per prompt), seeds 0..4499;
    # each prompt's test fails at significance 1e-3.
    assert min(tli_pvalues(CrossVocabProposer, 1500)) > 1e-3


@pytest.mark.slow
def test_chi_square_detects_a_tli_whose_q_is_not_what_it_sampled_from():
    assert min(tli_pvalues(HalfQ, 500)) < 1e-6


@pytest.fixture(scope="module")
def foreign_pair(char_tokenizer):
    """A tiny Llama target with the tests' char tokenizer, and a tiny Llama draft with a tokenizer
    of other ids, an unshared character and the target's specials."""
    target_tok = char_tokenizer
    vocab = {t: i for i, t in enumerate(reversed(list(target_tok.get_vocab())))}
    vocab["z"] = len(vocab)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    draft_tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    target = HFCausalLM(tiny_llama(0, vocab=len(target_tok)))
    draft_model = tiny_llama(0, vocab=len(target_tok))
    # the draft: the target's weights with the vocabulary rows permuted to its own ids, plus noise
    order = [target_tok.get_vocab()[t] for t in sorted(vocab, key=vocab.get) if t in target_tok.get_vocab()]
    with torch.no_grad():
        draft_model.model.embed_tokens.weight[:] = draft_model.model.embed_tokens.weight[order]
        draft_model.lm_head.weight[:] = draft_model.lm_head.weight[order]
    draft_model.resize_token_embeddings(len(vocab))
    return target, HFCausalLM(draft_model), target_tok, draft_tok


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_greedy_with_a_foreign_draft_equals_plain_greedy(foreign_pair, method):
    target, draft, target_tok, draft_tok = foreign_pair
    prompts = [[4, 5, 6, 7, 8], [9, 10, 4], [6, 6, 12, 13]]
    greedy = SamplingParams(temperature=0)
    plain = [r.token_ids for r in run_all(target, None, [Request(p, DecodeConfig(20, greedy)) for p in prompts],
                                          tokenizer=target_tok)]
    proposer = CrossVocabProposer(draft, draft_tok, target_tok, target.vocab_size, method=method, min_shared=10)
    results = run_all(target, proposer, [Request(p, DecodeConfig(20, greedy, num_speculative_tokens=4))
                                         for p in prompts], tokenizer=target_tok)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.num_accepted for r in results) > 10  # the permuted draft agrees with the target


def test_a_seeded_sampled_request_with_a_foreign_draft_is_the_same_alone_and_in_a_batch(foreign_pair):
    target, draft, target_tok, draft_tok = foreign_pair
    config = DecodeConfig(16, SamplingParams(temperature=1.0, seed=7), num_speculative_tokens=3)

    def decode(prompts):
        proposer = CrossVocabProposer(draft, draft_tok, target_tok, target.vocab_size, min_shared=10)
        return run_all(target, proposer, [Request(p, config) for p in prompts], tokenizer=target_tok)

    alone = decode([[4, 5, 6]])[0].token_ids
    assert decode([[9, 9, 9, 9], [4, 5, 6], [7]])[1].token_ids == alone


def test_a_small_vocabulary_shared_almost_whole_is_accepted(foreign_pair):
    """14 of the target's 15 token strings: not "too few" (the floor of 1000 is for large vocabularies)."""
    target, draft, target_tok, draft_tok = foreign_pair
    assert CrossVocabProposer(draft, draft_tok, target_tok, target.vocab_size).num_shared == 14


def test_a_pair_sharing_too_few_token_strings_is_refused():
    target_tok = char_tokenizer({**{f"t{i}": i for i in range(2100)}, **{c: 2100 + i for i, c in enumerate("abcdefghijk")},
                                 "?": 2111})
    draft_tok = char_tokenizer({**{f"d{i}": i for i in range(2100)}, **{c: 2100 + i for i, c in enumerate("abcdefghijk")},
                                "?": 2111})
    with pytest.raises(ValueError, match="share 12 token strings .* too few"):
        CrossVocabProposer(HFCausalLM(tiny_llama(0, hidden=32, vocab=2112)), draft_tok, target_tok, 2112)


def test_tli_one_step_by_enumeration_gives_p_exactly():
    """The q TLI reports is the draft's distribution over the shared strings, renormalized, moved
    to the target's ids (checked against a direct computation from the table and the strings);
    enumerating one step's outcomes with it gives p to 1e-6, and a q left unnormalized does not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_verify import step_output_distribution

    target = TableModel(5, order=2, seed=20, sharpness=1.5)
    draft = TableModel(6, order=2, seed=21, sharpness=1.5)
    prompt = [1, 2]  # "bc" → the draft reads b c as its ids 3 2
    proposer = CrossVocabProposer(draft, DRAFT_TOK, TARGET_TOK, 5, method="tli", min_shared=3)
    proposer.add_row(prompt)

    class Row:
        tokens, sampling, generator = prompt, SamplingParams(), torch.Generator().manual_seed(0)

    q = proposer.propose([Row()], [1])[0].probs[0].double()
    draft_probs = torch.softmax(draft.logits_for([3, 2]).double(), -1)
    expected = torch.zeros(5, dtype=torch.float64)
    for draft_id, target_id in ((1, 3), (2, 2), (3, 1), (5, 4)):  # d c b ? are shared; x e are not
        expected[target_id] = draft_probs[draft_id]
    expected /= expected.sum()
    assert torch.allclose(q, expected, atol=1e-6) and q[0] == 0  # "a" is the target's alone
    p = torch.softmax(target.logits_for(prompt).double(), -1)
    assert torch.allclose(step_output_distribution(p, q), p, atol=1e-6)
    # the same draft without the renormalization (the shared strings' raw mass) is off by far more
    assert (step_output_distribution(p, q * draft_probs[[1, 2, 3, 5]].sum()) - p).abs().max() > 1e-3
