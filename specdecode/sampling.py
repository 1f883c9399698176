"""Standardized sampling (paper §2.2): every decoding rule is plain sampling from an adjusted
distribution. The same adjustment is applied to the target's logits (p) and the draft's (q), so
the verifier sees exactly the distributions the tokens were sampled from (docs/exactness.md rule 1).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

# float32 rounds a temperature at or below 2**-150 (≈ 7e-46) to 0, and adjust divides float32
# logits by it: such a temperature is the limit T → 0 of softmax(l / T), which is greedy.
GREEDY_TEMPERATURE_AT_MOST = 2.0 ** -150


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the distribution that is sampled (paper §2.2).

    temperature: 0 means greedy (a one-hot distribution on the argmax, lowest id wins ties). A
        positive temperature too small for float32 (≤ 2**-150 ≈ 7e-46; it would round to 0 and
        divide by zero) is greedy too: softmax(l / T) tends to the argmax as T → 0. Any larger
        temperature is applied as given.
    top_k: keep the k most likely tokens (and any tied with the k-th); 0 keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all.
    min_p: drop tokens whose probability is below min_p × the top token's; 0.0 keeps all.
    seed: seeds the request's torch.Generator; None draws a fresh seed.
    repetition_penalty: > 0, 1.0 = off; transformers' semantics (RepetitionPenaltyLogitsProcessor):
        the logit of every id in the prefix, prompt included, is divided by it if positive and
        multiplied by it if negative.
    presence_penalty, frequency_penalty: in [-2, 2], 0.0 = off; OpenAI's semantics over the
        generated tokens only: logit −= frequency_penalty × count + presence_penalty × [count > 0].
    The penalties apply to the raw logits before temperature and the filters, at every position
    from the prefix up to it, on the target's side and the draft's (specdecode.processors).
    logit_bias: {token id: bias in [-100, 100]} added to the raw logits (after the penalties,
        before temperature and the filters), OpenAI's semantics; -100 in effect bans a token.
        Stored as a dict of int → float; not part of the hash.
    min_tokens: the EOS ids are masked (−inf) on both sides until this many tokens were
        generated (transformers' min_new_tokens, vLLM's min_tokens); stop strings still end it.
    ignore_eos: EOS does not end the output: it is a token like any other, and the output runs to
        max_new_tokens (or a stop string); vLLM's ignore_eos. Its text is empty.
    Float fields take any real number but a bool (an int is fine), integer fields any integer but
    a bool; numpy scalars are stored as the Python float or int.

    Raises:
        TypeError: a field of the wrong type (the message names the field).
        ValueError: on a negative or infinite temperature, a negative top_k, top_p outside (0, 1],
            min_p outside [0, 1), a seed outside [-2**63, 2**64), repetition_penalty <= 0 or
            infinite, presence_penalty or frequency_penalty outside [-2, 2], a logit_bias id < 0
            or bias outside [-100, 100], min_tokens < 0.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        self._check_types()
        self._check_logit_bias()
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")

    def _check_types(self) -> None:
        """TypeError on a wrong type; numbers are stored as the field's Python type (torch refuses
        numpy integers as a seed)."""
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float),
                           ("seed", int), ("repetition_penalty", float), ("presence_penalty", float),
                           ("frequency_penalty", float), ("min_tokens", int)):
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
                wanted = ("an integer" if kind is int else "a number (int or float)") + (" or None" if name == "seed" else "")
                raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
            try:
                object.__setattr__(self, name, kind(value))
            except OverflowError:  # an int beyond float's range, e.g. temperature=10**400
                raise ValueError(f"{name} must be finite, got {value!r}") from None
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {type(self.logit_bias).__name__}")
        bias = {}
        for token, value in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
            bias[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", bias or None)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE_AT_MOST


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): [...] int64, the first maximum on the last dim (the lowest id wins ties).
    float32 CPU tensors go through numpy: torch 2.13's CPU argmax reads a 151936-entry vocabulary
    in 0.29 ms and [9, 151936] in 1.9 ms, numpy in 0.012 and 0.26 ms (measured 2026-12-06), i.e.
    ~2 ms of every greedy speculative step and 0.3 ms of every plain one."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))
    return x.argmax(-1)


def adjust(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the adjusted distribution that is actually sampled (paper §2.2).

    Args:
        logits: [..., V] any float dtype.
        params: the request's sampling settings.
    Returns:
        [..., V] float32 probabilities summing to 1 on the last dim. Greedy gives a one-hot
        vector on the argmax (the lowest index wins ties). Filters apply in the order
        temperature, top-k, top-p, min-p, each on the renormalized result of the previous.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(first_argmax(logits), logits.shape[-1]).float()
    # Subtract the max before dividing: a tiny temperature would otherwise overflow to inf − inf.
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = probs.topk(params.top_k, dim=-1).values[..., -1:]
        probs = _renormalize(probs.masked_fill(probs < kth, 0.0))
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token is kept if the mass strictly before it is still below top_p, so the top
        # token is always kept and the kept set is the smallest that reaches top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # also when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = _renormalize(probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        probs = _renormalize(probs.masked_fill(probs < threshold, 0.0))
    return probs


def _renormalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., V] float32 (need not be normalized) → [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


# --- the exponential race: a token as a pure function of (seed, position) -------------------------------
#
# argmax_i p_i / E_i with E_i i.i.d. Exp(1) is token i with probability p_i / Σ p (the Gumbel-max
# trick in exponential form: min_i E_i / p_i is Exp(Σ p), attained at i with probability p_i / Σ p).
# Drawing E from a counter-based generator keyed by the request's seed and the token's position makes
# the token at each position a function of the prefix alone: the same whichever drafts were offered,
# with speculation or without (Daliri, Musco, Suresh, "Coupling without Communication and
# Drafter-Invariant Speculative Decoding", arXiv 2408.07978).


@functools.lru_cache(maxsize=32)
def race_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """E ~ Exp(1) i.i.d.: [size] float32, a pure function of (seed, position, index). Read only:
    the last 32 are kept (20 MB at 151,936 ids), since the draft model races at the positions the
    target then verifies.

    Philox-4x64 keyed by the seed (mod 2**64), its counter starting at `position` in its top word,
    so positions never share numbers; uniforms from the top 24 bits of each 64-bit word, centred
    ((j + 0.5) / 2**24, never 0 or 1), E = -log(u). A shorter size gives a prefix of a longer one,
    so a draft with a smaller (or padded) vocabulary sees the target's numbers for the ids it has.
    About 1 ms for 151,936 ids (numpy; measured 2026-12-07 on a Zen 4).
    """
    raw = np.random.Philox(key=seed % 2**64, counter=[0, 0, 0, position]).random_raw(size)
    u = (raw >> np.uint64(40)).astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(2.0 ** -24)
    np.log(u, out=u)
    np.negative(u, out=u)
    return torch.from_numpy(u)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's winner, argmax probs / noise on the last dim: [...] int64.

    probs: [..., V] float32, need not be normalized (zeros never win).  noise: [..., V'] from
    race_noise, V' >= V (its first V entries are used). With fresh noise per position this is an
    exact sample of norm(probs), as torch.multinomial is, but determined by the noise.
    """
    return first_argmax(probs.float() / noise[..., :probs.shape[-1]])


def race_seed(generator: torch.Generator) -> int:
    """The seed a row's race noise is keyed by: its generator's (SamplingParams.seed, or the fresh
    seed drawn for seed=None)."""
    return generator.initial_seed()


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator on the device its tensors live on (docs/exactness.md rule 7); a None seed
    draws a fresh one."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
