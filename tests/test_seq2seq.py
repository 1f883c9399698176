"""Encoder–decoder models (paper §4.1: T5 target, smaller T5 draft), tiny, random, float32:
greedy equals transformers' generate, the decoder cache rolls back exactly, and sampling gives
the target's exact distribution."""

import itertools
from collections import Counter

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.engine.driver import run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import Seq2SeqLM
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.sampling import adjust

from helpers import MislabelledProposer, chi2_pvalue, decode, tiny_llama, tiny_t5

VOCAB = 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These models are tiny: on a shared 2-core machine, intra-op threads cost 10x more than
    # they save (measured: 200 sampled runs took 26 s with 2 threads, 1.7 s with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SOURCE = [5, 17, 33, 2, 41, 8, 1]  # encoder input, ending in T5's </s> (id 1)


def noisy_copy(model, scale, seed):
    """A draft that often agrees with `model` but not always: its weights plus noise."""
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return draft


@pytest.fixture(scope="module")
def t5_pair():
    target = tiny_t5(0)
    return target, noisy_copy(target, 0.02, seed=1)


def run_seq2seq(target, proposer, config, source=SOURCE):
    """One request through the engine: the encoder reads `source`, the decoder starts from 0."""
    return run_all(target, proposer, [Request([0], config, encoder_input_ids=source)])[0]


def greedy(n, k, eos=()):
    return DecodeConfig(max_new_tokens=n, sampling=SamplingParams(temperature=0), num_speculative_tokens=k,
                        eos_token_ids=frozenset(eos))


def reference_generate(model, source, n, eos):
    with torch.no_grad():
        out = model.generate(torch.tensor([source]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, decoder_start_token_id=0)
    return out[0, 1:].tolist()  # generate returns the decoder start token first


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_equals_transformers_generate_token_for_token(t5_pair, k):
    target, draft = t5_pair
    # An EOS id the target really emits (the first token that first appears at position >= 3),
    # so stopping is compared too.
    free_run = run_seq2seq(Seq2SeqLM(target), None, greedy(24, 0)).token_ids
    eos = next(t for i, t in enumerate(free_run) if i >= 3 and t not in free_run[:i])
    reference = reference_generate(target, SOURCE, 24, eos)
    assert reference[-1] == eos and len(reference) < 24
    spec = run_seq2seq(Seq2SeqLM(target), DraftModelProposer(Seq2SeqLM(draft)), greedy(24, k, eos=[eos]))
    assert spec.token_ids == reference and spec.finish_reason == "eos"
    assert 0 < spec.stats.num_accepted < spec.stats.num_drafted  # both paths exercised
    # Without an EOS: the full length, still equal.
    long = run_seq2seq(Seq2SeqLM(target), DraftModelProposer(Seq2SeqLM(draft)), greedy(40, k))
    assert long.token_ids == reference_generate(target, SOURCE, 40, None)


class CheckedSeq2Seq(Seq2SeqLM):
    """At every forward: the self-attention cache holds exactly the tokens the backend was told
    to keep, the cross-attention cache is untouched, and the logits from the rolled-back cache
    equal those of a fresh forward over the whole decoder sequence without a cache. Keeps the
    decoder tokens held after the last truncate (the row leaves the backend when it finishes)."""

    def __init__(self, model, committed):
        super().__init__(model)
        self.committed = committed
        self.tokens: list[int] = []
        self.snapshots = []
        self.max_error = 0.0
        self.after_truncate = None

    def reset(self):
        super().reset()
        self.tokens = []

    def add_row(self, encoder_input_ids=None):
        super().add_row(encoder_input_ids)
        self.tokens = []

    def forward(self, feeds, num_logits):
        assert self.cache.get_seq_length() == len(self.tokens) and self.lengths == [len(self.tokens)]
        if self._cross_cache is not None:
            assert self.cache.cross_attention_cache is self._cross_cache
            assert self._cross_cache.get_seq_length() == len(self.input_ids)
        self.snapshots.append((list(self.tokens), list(feeds[0]), len(self.committed)))
        logits = super().forward(feeds, num_logits)  # [1, num_logits, V]
        self.tokens += feeds[0]
        with torch.no_grad():
            fresh = self.model(input_ids=torch.tensor([self.input_ids]),
                               decoder_input_ids=torch.tensor([self.tokens])).logits[0, -num_logits:]
        # relative to the logits' scale (they reach the hundreds at init=5): float32 rounding only
        self.max_error = max(self.max_error, float((fresh - logits[0]).abs().max() / fresh.abs().max()))
        return logits

    def truncate(self, lengths):
        super().truncate(lengths)
        del self.tokens[lengths[0]:]
        assert self.cache.get_seq_length() == len(self.tokens) and self.lengths == [len(self.tokens)]
        self.after_truncate = list(self.tokens)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(seed=3)], ids=["greedy", "t1"])
def test_decoder_cache_holds_exactly_the_committed_prefix_after_every_step(t5_pair, sampling):
    target_model, draft_model = t5_pair
    committed = [0]
    target, draft = CheckedSeq2Seq(target_model, committed), CheckedSeq2Seq(draft_model, committed)
    config = DecodeConfig(max_new_tokens=30, sampling=sampling, num_speculative_tokens=4)
    for event in decode(target, DraftModelProposer(draft), [0], config, encoder_input_ids=SOURCE):
        committed.append(event.token_id)
    assert len(committed) == 31
    for i, (cache, fed, n) in enumerate(target.snapshots):
        if i == 0:
            assert cache == [] and fed[0] == 0
        else:  # the committed sequence minus its last token, which is fed first
            assert cache == committed[:n - 1] and fed[0] == committed[n - 1]
    first_forward_of_step = {}
    for cache, fed, n in draft.snapshots:
        first_forward_of_step.setdefault(n, (cache, fed))
    for n, (cache, fed) in first_forward_of_step.items():  # a committed prefix, completed by its feed
        assert cache + fed == committed[:n]
    assert target.after_truncate == committed[:-1]  # all but the last token, which is pending
    assert target.max_error < 1e-5 and draft.max_error < 1e-5
    # drafts scored (and rolled back) at every step but a last one clipped to γ = 0
    assert sum(len(fed) > 1 for _, fed, _ in target.snapshots) >= len(target.snapshots) - 1
    if sampling.greedy:
        assert len(target.snapshots) < 30  # some drafts accepted: rollbacks were partial


def test_same_input_keeps_the_encoder_output_and_a_new_input_replaces_it(t5_pair):
    target, _ = t5_pair
    b = Seq2SeqLM(target)
    b.add_row(SOURCE)
    b.forward([[0, 7, 9]], 1)
    encoded, cross = b._encoder_outputs, b.cache.cross_attention_cache
    b.reset()
    b.add_row(list(SOURCE))  # the same input: the decoder cache empties, the encoder side stays
    assert b.lengths == [0] and b.cache.get_seq_length() == 0
    assert b._encoder_outputs is encoded and b.cache.cross_attention_cache is cross
    first = b.forward([[0, 7]], 1)[0]
    b.reset()
    b.add_row([6, 6, 1])
    assert b._encoder_outputs is not encoded
    other = b.forward([[0, 7]], 1)[0]
    with torch.no_grad():
        fresh = target(input_ids=torch.tensor([[6, 6, 1]]), decoder_input_ids=torch.tensor([[0, 7]])).logits[0, -1:]
    assert torch.allclose(other, fresh, atol=1e-5) and not torch.allclose(first, other)


def test_forward_without_a_row_a_row_without_input_a_second_row_and_decoder_only_models_raise():
    b = Seq2SeqLM(tiny_t5(0, layers=1))
    with pytest.raises(ValueError, match="need 0 feeds, not all empty"):
        b.forward([[0]], 1)
    with pytest.raises(ValueError, match="needs the request's encoder input"):
        b.add_row()
    b.add_row(SOURCE)
    assert b.max_rows == 1 and b.num_rows == 1
    with pytest.raises(ValueError, match="holds one row at a time"):
        b.add_row(SOURCE)
    with pytest.raises(ValueError, match="not an encoder-decoder"):
        Seq2SeqLM(tiny_llama(0, layers=1))


def test_the_engine_queues_requests_for_the_one_row_backend_and_each_equals_its_run_alone(t5_pair):
    target, draft = t5_pair
    sources = [SOURCE, [6, 6, 1], [9, 30, 12, 1]]
    configs = [greedy(12, 3), DecodeConfig(max_new_tokens=10, sampling=SamplingParams(seed=4),
                                           num_speculative_tokens=2), greedy(8, 4)]
    requests = [Request([0], config, encoder_input_ids=source) for source, config in zip(sources, configs)]
    batch = run_all(Seq2SeqLM(target), DraftModelProposer(Seq2SeqLM(draft)), requests)
    for source, config, got in zip(sources, configs, batch):
        alone = run_seq2seq(Seq2SeqLM(target), DraftModelProposer(Seq2SeqLM(draft)), config, source)
        assert got.token_ids == alone.token_ids and len(got.token_ids) == config.max_new_tokens
    assert len({tuple(r.token_ids[:8]) for r in batch}) == 3  # each row decoded its own input


# --- exact distribution at temperature 1 ---

DIST_VOCAB, DIST_LEN, DIST_K = 6, 3, 2


@pytest.fixture(scope="module")
def dist_pair():
    """A 2-layer target and a smaller 1-layer draft (the paper's T5-XXL / T5-small shape, tiny),
    with softened heads: every sequence has some mass, and p and q differ clearly."""
    return (tiny_t5(10, layers=2, d_model=32, vocab=DIST_VOCAB, init=1.0, head_scale=0.15),
            tiny_t5(11, layers=1, d_model=16, vocab=DIST_VOCAB, init=1.0, head_scale=0.15))


def exact_sequence_probs(model, source, length):
    """P(s_1..s_L | source) by direct forwards of the whole decoder prefix (chain rule)."""
    probs = {}
    cond = {}
    with torch.no_grad():
        for n in range(length):
            for prefix in itertools.product(range(DIST_VOCAB), repeat=n):
                logits = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([[0, *prefix]])).logits
                cond[prefix] = adjust(logits[0, -1], SamplingParams()).double()
    for seq in itertools.product(range(DIST_VOCAB), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(cond[seq[:i]][seq[i]])
        probs[seq] = prob
    return probs


def pooled(observed, probs, runs, min_expected=5.0):
    """Pool the categories expected fewer than `min_expected` times into one (chi-square's
    approximation needs it; pooling cannot hide a wrong distribution elsewhere)."""
    small = [i for i, p in enumerate(probs) if p * runs < min_expected]
    keep = [i for i in range(len(probs)) if i not in small]
    return ([observed[i] for i in keep] + [sum(observed[i] for i in small)],
            [probs[i] for i in keep] + [sum(probs[i] for i in small)])


def seq2seq_loop_counts(pair, make_proposer, runs):
    target_model, draft_model = pair
    source = [3, 4, 5, 1]
    target, draft = Seq2SeqLM(target_model), Seq2SeqLM(draft_model)
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=DIST_LEN, sampling=SamplingParams(seed=seed), num_speculative_tokens=DIST_K)
        counts[tuple(run_seq2seq(target, make_proposer(draft), config, source).token_ids)] += 1
    expected = exact_sequence_probs(target_model, source, DIST_LEN)
    seqs = sorted(expected)
    return pooled([counts[s] for s in seqs], [expected[s] for s in seqs], runs)


@pytest.mark.slow
def test_seq2seq_sampling_matches_target_distribution_chi_square(dist_pair):
    # 2000 seeded runs (vocab 6, 3 tokens → 216 sequences, γ = 2), significance 1e-3: a correct
    # implementation fails 1 time in 1000.
    observed, probs = seq2seq_loop_counts(dist_pair, DraftModelProposer, runs=2000)
    assert chi2_pvalue(observed, probs) > 1e-3


@pytest.mark.slow
def test_seq2seq_chi_square_detects_a_proposer_that_misreports_q(dist_pair):
    observed, probs = seq2seq_loop_counts(dist_pair, MislabelledProposer, runs=1000)
    assert chi2_pvalue(observed, probs) < 1e-6


# --- BART, and the public API on models saved to disk ---

def tiny_bart(seed, layers, vocab=VOCAB):
    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=32, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, forced_bos_token_id=None)
    return BartForConditionalGeneration(config).eval()


def test_bart_speculative_greedy_equals_transformers_generate():
    target = tiny_bart(0, 2)
    draft = noisy_copy(target, 0.02, seed=2)
    source = [0, 9, 14, 22, 5, 2]
    start = Seq2SeqLM(target).decoder_start_token_id
    b_target, b_draft = Seq2SeqLM(target), Seq2SeqLM(draft)
    spec = run_all(b_target, DraftModelProposer(b_draft), [Request([start], greedy(30, 3), encoder_input_ids=source)])[0]
    with torch.no_grad():
        reference = target.generate(torch.tensor([source]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                                    pad_token_id=1, forced_bos_token_id=None, forced_eos_token_id=None)
    assert spec.token_ids == reference[0, 1:].tolist()
    assert spec.stats.num_accepted > 0
    assert b_target.max_length == 64


@pytest.fixture(scope="module")
def seq2seq_dirs(tmp_path_factory, request):
    tokenizer = request.getfixturevalue("char_tokenizer")
    root = tmp_path_factory.mktemp("seq2seq")
    target = tiny_t5(0, vocab=len(tokenizer))
    models = {"target": target, "draft": noisy_copy(target, 0.02, seed=1),
              "small": tiny_t5(5, layers=1, d_model=16, vocab=len(tokenizer))}
    dirs = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def test_decoder_loads_seq2seq_paths_and_matches_generate(seq2seq_dirs, char_tokenizer):
    from transformers import AutoModelForSeq2SeqLM

    decoder = SpeculativeDecoder(seq2seq_dirs["target"], seq2seq_dirs["draft"], num_speculative_tokens=3,
                                 dtype="float32")
    assert decoder.pair.is_encoder_decoder
    result = decoder.generate("abc", max_new_tokens=16, sampling=SamplingParams(temperature=0))
    source = char_tokenizer.encode("abc", add_special_tokens=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(seq2seq_dirs["target"], dtype=torch.float32).eval()
    reference = reference_generate(model, source, 16, 1)
    assert result.token_ids == reference
    assert result.text == char_tokenizer.decode(reference, skip_special_tokens=True)
    assert result.stats.num_drafted > 0 and not result.stats.lossy
    # token ids go to the encoder verbatim; a batch gives one result per prompt
    by_ids = decoder.generate(source, max_new_tokens=16, sampling=SamplingParams(temperature=0))
    assert by_ids.token_ids == reference
    batch = decoder.generate(["abc", "hh"], max_new_tokens=8, sampling=SamplingParams(temperature=0))
    assert batch[0].token_ids == reference[:8] and len(batch) == 2
    # a smaller draft of another architecture, sampling, lenience: still runs end to end
    small = SpeculativeDecoder(seq2seq_dirs["target"], seq2seq_dirs["small"], dtype="float32", num_speculative_tokens=2)
    sampled = small.generate("abc", max_new_tokens=8, sampling=SamplingParams(seed=0), lenience=0.5)
    assert sampled.stats.lossy and len(sampled.token_ids) <= 8
    # loaded by path, the default leaves an encoder–decoder draft as it is; asking for int8 raises
    from specdecode.models.quant import QUANTIZED_LINEAR

    assert not any(isinstance(m, QUANTIZED_LINEAR) for m in decoder.draft.backend.model.modules())
    with pytest.raises(ValueError, match="decoder-only drafts only"):
        SpeculativeDecoder(seq2seq_dirs["target"], seq2seq_dirs["draft"], dtype="float32", quantize_draft="int8")


def test_encoder_decoder_and_decoder_only_models_do_not_mix(seq2seq_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(seq2seq_dirs["target"])
    llama = tiny_llama(0, layers=1, vocab=len(tokenizer))
    with pytest.raises(ValueError, match="encoder-decoder model but draft"):
        SpeculativeDecoder(seq2seq_dirs["target"], llama, tokenizer=tokenizer, dtype="float32")
    with pytest.raises(ValueError, match="decoder-only model but draft"):
        SpeculativeDecoder(llama, seq2seq_dirs["draft"], tokenizer=tokenizer, dtype="float32")
    with pytest.raises(ValueError, match="zoo draft"):  # refused before the zoo model is loaded
        SpeculativeDecoder(seq2seq_dirs["target"], dtype="float32")
    with pytest.raises(ValueError, match="draft_vocab_limit"):
        SpeculativeDecoder(seq2seq_dirs["target"], seq2seq_dirs["draft"], draft_vocab_limit=8, dtype="float32")
    decoder = SpeculativeDecoder(seq2seq_dirs["target"], None, dtype="float32")
    with pytest.raises(ValueError, match="chat=True"):
        decoder.generate("abc", max_new_tokens=2, chat=True)
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.generate("", max_new_tokens=2)


def test_prompt_lookup_on_the_decoder_keeps_the_greedy_output(t5_pair):
    target, draft = t5_pair
    plain = run_seq2seq(Seq2SeqLM(target), None, greedy(40, 0))
    proposer = FallbackProposer(PromptLookupProposer(VOCAB, max_ngram=2, min_ngram=1),
                                DraftModelProposer(Seq2SeqLM(draft)))
    spec = run_seq2seq(Seq2SeqLM(target), proposer, greedy(40, 4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_lookup_steps > 0


def test_cli_runs_an_encoder_decoder_pair(seq2seq_dirs, capsys):
    import json

    from specdecode.cli import main

    args = ["generate", "abc", "--target", seq2seq_dirs["target"], "--temperature", "0", "--max-new-tokens", "10",
            "--dtype", "float32", "--json", "--quiet"]
    assert main(args + ["--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--draft", seq2seq_dirs["draft"], "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["stats"]["num_drafted"] > 0 and spec["stats"]["lossy"] is False
