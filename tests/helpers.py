"""Shared test helpers: tiny models, exact sequence distributions, a chi-square test, and a
proposer that breaks the protocol on purpose. Test files import from here, never from each other."""

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdecode.engine.driver import Driver, run
from specdecode.engine.engine import Engine
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import TableModel
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams, adjust
from specdecode.verify import acceptance_probs, residual_distribution

# --- tiny float32 Llamas ---------------------------------------------------------------------------

VOCAB = 96
PROMPT = [5, 17, 33, 2, 71, 40, 8]


def tiny_llama(seed, layers=2, hidden=64, vocab=VOCAB):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def peaked_llama(seed, vocab, scale=30.0):
    """A tiny Llama whose LM head is scaled up: sharp distributions (its top token 0.45-0.99 with
    seed 0 and vocab 14), so sampled outputs repeat and earlier ones make good drafts."""
    model = tiny_llama(seed, layers=1, vocab=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def greedy_continuation(model, prompt, n):
    """The n tokens a transformers causal LM continues `prompt` with under greedy decoding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def tiny_mistral(seed, layers):
    """A tiny Mistral with an 8-token sliding window (such a backend holds one row: max_rows = 1)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=8, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return MistralForCausalLM(config).eval()


def greedy(n):
    return DecodeConfig(max_new_tokens=n, sampling=SamplingParams(temperature=0), num_speculative_tokens=0)


def single_row_logits(backend, sequence, num_logits):
    """[num_logits, V]: the backend's logits after each of the last num_logits tokens of
    `sequence`, computed in one row from an empty cache."""
    backend.reset()
    backend.add_row()
    return backend.forward([list(sequence)], num_logits)[0]


# --- driving the engine ----------------------------------------------------------------------------

def decode(target, proposer, prompt_ids, config, tokenizer=None, encoder_input_ids=None):
    """One request's TokenEvents as they come; the generator's return value is its result."""
    driver = Driver(Engine(target, proposer, tokenizer))
    return driver.stream(driver.submit(Request(prompt_ids, config, encoder_input_ids), keep_events=True))


def drain(stream, each=None):
    """(every item of a generator, its return value); each(item) is called as each one comes."""
    items = []
    while True:
        try:
            item = next(stream)
        except StopIteration as done:
            return items, done.value
        items.append(item)
        if each is not None:
            each(item)


class FakeClock:
    """A clock that moves only when told (Engine(clock=...), DraftModelProposer(clock=...)): timed
    tests then see the same seconds whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- statistics ------------------------------------------------------------------------------------

def random_probs(shape, generator, zero_frac=0.0):
    logits = torch.randn(shape, generator=generator) * 2
    probs = torch.softmax(logits, -1)
    if zero_frac:
        mask = torch.rand(shape, generator=generator) < zero_frac
        mask[..., 0] = False  # keep at least one entry
        probs = probs.masked_fill(mask, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def chi2_pvalue(observed, probs):
    """Chi-square goodness-of-fit p-value of counts against probabilities (categories with
    zero probability must have zero counts, else the p-value is 0)."""
    from scipy.stats import chisquare

    observed = torch.as_tensor(observed, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if (observed[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * observed.sum()
    return float(chisquare(observed[keep].numpy(), expected.numpy()).pvalue)


def pooled_chi2_pvalue(counts: Counter, probs: dict, min_expected: float = 5.0):
    """Chi-square p-value of counted sequences against their exact probabilities, the sequences
    expected fewer than min_expected times pooled into one category; and how many were not pooled."""
    n = sum(counts.values())
    kept = [s for s in probs if probs[s] * n >= min_expected]
    observed = [counts[s] for s in kept] + [n - sum(counts[s] for s in kept)]
    expected = [probs[s] for s in kept] + [max(0.0, 1.0 - sum(probs[s] for s in kept))]
    return chi2_pvalue(observed, expected), len(kept)


# --- exact sequence distributions of table models ---------------------------------------------------

def sequence_pvalues(target, prompts, counts, length, params=None):
    """Per prompt, the chi-square p-value of its counted output sequences (Counter of tuples)
    against the target's exact sequence distribution (temperature 1 by default)."""
    pvalues = []
    for prompt, count in zip(prompts, counts):
        expected = target_sequence_probs(target, prompt, length, params or SamplingParams())
        seqs = sorted(expected)
        pvalues.append(chi2_pvalue([count[s] for s in seqs], [expected[s] for s in seqs]))
    return pvalues


def target_sequence_probs(target, prompt, length, params):
    """P(s_1..s_L) = Π p(s_i | prompt + s_<i), over all sequences (chain rule)."""
    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(adjust(target.logits_for(prompt + list(seq[:i])), params)[seq[i]])
        probs[seq] = prob
    return probs


def model_sequence_probs(model, prompt, length):
    """P(s_1..s_L) at temperature 1 under a transformers causal LM (float32), over all
    sequences: one batched forward per position."""
    probs = {(): 1.0}
    for _ in range(length):
        seqs = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt) + list(s) for s in seqs])).logits[:, -1].float()
        rows = torch.softmax(logits, -1).tolist()
        probs = {s + (t,): probs[s] * p for s, row in zip(seqs, rows) for t, p in enumerate(row)}
    return probs


# The sizes and samplings the exact sequence distributions are checked at: table vocabularies, γ and
# lengths small enough to enumerate every draft block and outcome.
SMALL_CASES = pytest.mark.parametrize("vocab,k,length", [(3, 2, 3), (3, 3, 4), (4, 2, 3)])
SAMPLINGS = pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=2), SamplingParams(top_p=0.8),
               SamplingParams(temperature=0)], ids=["t1", "t0.7-topk2", "topp0.8", "greedy"])


def enumerated_sequence_probs(target, draft, prompt, length, k, params, outcomes):
    """Exact distribution of the first `length` tokens the loop emits, enumerating every draft
    block (γ clipped to the tokens still wanted, as the engine does) and every outcome of verifying
    it: outcomes(drafts, q [k, V], p [k+1, V]) → {(drafts kept, emitted tokens): probability}."""
    out = Counter()

    def step(emitted, prob):
        if len(emitted) >= length:
            out[tuple(emitted[:length])] += prob
            return
        prefix = prompt + emitted
        k_step = min(k, length - len(emitted) - 1)
        for drafts in itertools.product(range(draft.vocab_size), repeat=k_step):
            q = torch.stack([adjust(draft.logits_for(prefix + list(drafts[:i])), params) for i in range(k_step)]
                            ) if k_step else torch.zeros(0, draft.vocab_size)
            p = torch.stack([adjust(target.logits_for(prefix + list(drafts[:i])), params) for i in range(k_step + 1)])
            q_block = 1.0
            for i, x in enumerate(drafts):
                q_block *= float(q[i, x])
            if q_block == 0:
                continue
            for (_, tokens), prob_outcome in outcomes(list(drafts), q, p).items():
                step(emitted + list(tokens), prob * q_block * prob_outcome)

    step([], 1.0)
    return out


def token_outcomes(drafts, q, p, lenience=1.0):
    """Exact {(n kept, emitted tokens): prob} of verifying one block token by token (Algorithm 1;
    lenience < 1: the lossy acceptance min(1, p/(l·q)) of paper A.5, residual unchanged)."""
    k = len(drafts)
    accept = [float(acceptance_probs(torch.tensor([[drafts[i]]]), q[i].view(1, 1, -1), p[i].view(1, 1, -1), lenience))
              for i in range(k)]
    out, kept = {}, 1.0
    for n in range(k + 1):
        stop, next_dist = (kept * (1 - accept[n]), residual_distribution(p[n], q[n])) if n < k else (kept, p[k])
        for t in range(p.shape[-1]):
            if stop * next_dist[t] > 0:
                out[(n, tuple(drafts[:n]) + (t,))] = stop * float(next_dist[t])
        if n < k:
            kept *= accept[n]
    return out


def speculative_sequence_probs(target, draft, prompt, length, k, params, lenience=1.0):
    """Exact distribution of the first `length` tokens emitted by Algorithm 1 (token_outcomes)."""
    return enumerated_sequence_probs(target, draft, prompt, length, k, params,
                                     lambda drafts, q, p: token_outcomes(drafts, q, p, lenience))


def loop_sequence_counts(make_proposer, params, runs, vocab=4, k=3, length=3, **options):
    """Counts of the first `length` tokens over `runs` seeded runs of the engine (seeds 0..runs-1),
    and the target's exact probabilities of the same sequences, in the same order."""
    target = TableModel(vocab, order=2, seed=20, sharpness=1.5)
    draft = TableModel(vocab, order=2, seed=21, sharpness=1.5)
    counts = Counter()
    for seed in range(runs):
        config = DecodeConfig(max_new_tokens=length, sampling=SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed),
            num_speculative_tokens=k, **options)
        counts[tuple(run(target, make_proposer(draft), [1, 2], config).token_ids)] += 1
    expected = target_sequence_probs(target, [1, 2], length, params)
    seqs = sorted(expected)
    return [counts[s] for s in seqs], [expected[s] for s in seqs]


# --- a broken proposer -------------------------------------------------------------------------------

class UniformQFreeDrafts:
    """A broken proposer around a working one: its free (lookup) drafts report a uniform q instead
    of their one-hot q (violates rule 1: the verifier then keeps them too often)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, rows, ks):
        return [dataclasses.replace(d, probs=torch.full_like(d.probs, 1.0 / d.probs.shape[-1])) if d.lookup else d
                for d in self.inner.propose(rows, ks)]


class MislabelledProposer(DraftModelProposer):
    """A broken proposer: samples from the draft but reports uniform q (violates rule 1)."""

    def propose(self, rows, ks):
        return [dataclasses.replace(draft, probs=torch.full_like(draft.probs, 1.0 / draft.probs.shape[-1]))
                for draft in super().propose(rows, ks)]


# --- tiny encoder-decoder models ---------------------------------------------------------------

def tiny_t5(seed, layers=2, d_model=32, vocab=48, init=5.0, head_scale=1.0):
    """A random T5 (vocabulary 48 by default). At T5's default init a tiny decoder repeats its start token forever; init=5
    gives varied greedy outputs. head_scale < 1 softens the (untied) LM head's distributions."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=layers,
                      num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1, tie_word_embeddings=False, dropout_rate=0.0,
                      initializer_factor=init)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


# --- batch-invariant backends ---------------------------------------------------------------------

def stepwise(backend, prompt, tokens):
    """The logits after each of `tokens`, fed one at a time after the prompt: [len(tokens), V]."""
    backend.reset()
    backend.add_row(prefix_ids=prompt[:-1])
    out = [backend.forward([[prompt[-1]]], 1)[0, 0]]
    for token in tokens[:-1]:
        out.append(backend.forward([[token]], 1)[0, 0])
    return torch.stack(out)


def at_once(backend, prompt, tokens):
    """The same logits from one call holding the prompt's last token and all of `tokens` but the last."""
    backend.reset()
    backend.add_row(prefix_ids=prompt[:-1])
    return backend.forward([[prompt[-1], *tokens[:-1]]], len(tokens))[0]
