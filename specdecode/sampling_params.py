"""SamplingParams: how one request turns logits into the distribution it samples (paper §2.2),
checked on construction. Kept apart from the sampling arithmetic (specdecode.sampling, which
re-exports it) so that reading and checking options needs no torch (the CLI answers a bad flag
before it loads torch)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

# float32 rounds a temperature at or below 2**-150 (≈ 7e-46) to 0, and adjust divides float32
# logits by it: such a temperature is the limit T → 0 of softmax(l / T), which is greedy.
GREEDY_TEMPERATURE_AT_MOST = 2.0 ** -150
REPETITION_PENALTY_RANGE = (1e-20, 1e20)


class OptionError(ValueError):
    """An option out of range; `field` names it (the server answers 400 with it as the `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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
    repetition_penalty: in [1e-20, 1e20], 1.0 = off; transformers' semantics (RepetitionPenaltyLogitsProcessor):
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
        OptionError (a ValueError naming the field): on a negative or infinite temperature, a negative top_k, top_p outside (0, 1],
            min_p outside [0, 1), a seed outside [-2**63, 2**64), repetition_penalty outside
            [1e-20, 1e20], presence_penalty or frequency_penalty outside [-2, 2], a logit_bias id < 0
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
            raise OptionError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise OptionError("temperature", f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise OptionError("top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise OptionError("min_p", f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise OptionError("seed", f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if not REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            # beyond, a penalized logit leaves float32's range (logit / 1e-37 is +inf: NaN probabilities)
            raise OptionError("repetition_penalty", f"repetition_penalty must be in [1e-20, 1e20] (1 = off), "
                                                    f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise OptionError(name, f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")

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
                raise OptionError(name, f"{name} must be finite, got {value!r}") from None
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
                raise OptionError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
                raise OptionError("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
            bias[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", bias or None)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE_AT_MOST
