"""RequestOptions: one request's options and every check on them that needs no model.

The library (SpeculativeDecoder.generate, through RequestBuilder), the CLI (before any model
loads) and the batch job's flags build one and call validate(), so a rule and its message exist
once; the server's wire schema maps a body onto the same fields (RequestBuilder.from_wire). The
checks that need the target (a logit_bias id inside its vocabulary, prompt logprobs of a
decoder-only model, a grammar compiled for its tokenizer) stay in RequestBuilder.config.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from specdecode.config import DecoderConfig
from specdecode.sampling_params import OptionError, SamplingParams

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_CHOICES = 16   # n: choices per prompt


def is_int(value) -> bool:
    """An integer, numpy's too, but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # (numpy's bool is not Integral)


@dataclass(frozen=True)
class RequestOptions:
    """A request's options (SpeculativeDecoder.generate's arguments of the same names).

    max_new_tokens: the most new tokens (>= 1; 0 only with prompt_logprobs: score the prompt).
    sampling: SamplingParams (None: its defaults).  stop: strings that end the output (a string
    or a list; non-empty).  lenience: in (0, 1], 1 exact (below 1 lossy: paper A.5).
    logprobs, prompt_logprobs: None or alternatives per token in [0, MAX_LOGPROBS].
    n: choices per prompt in [1, MAX_CHOICES].
    """

    max_new_tokens: int = 256
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    lenience: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def validate(self, decoder: DecoderConfig | None = None) -> "RequestOptions":
        """These options checked, with sampling filled in and stop as a tuple. decoder: the
        decoder's options, whose verification rule limits lenience (DecoderConfig.check_lenience).

        Raises:
            OptionError (a ValueError; .field names it): a value out of range, min_tokens above
                max_new_tokens, an empty stop string.
            TypeError: sampling that is not a SamplingParams, stop that is not text.
        """
        least = 0 if self.prompt_logprobs is not None else 1
        if not is_int(self.max_new_tokens) or self.max_new_tokens < least:
            raise OptionError("max_new_tokens", f"max_new_tokens must be an integer >= 1 (0 only with "
                                                f"prompt_logprobs: score the prompt), got {self.max_new_tokens!r}")
        sampling = SamplingParams() if self.sampling is None else self.sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (or, for a list of prompts, a list of them), "
                            f"got {type(sampling).__name__}")
        if sampling.min_tokens > self.max_new_tokens:
            raise OptionError("min_tokens", f"min_tokens ({sampling.min_tokens}) must be at most max_new_tokens "
                                            f"({self.max_new_tokens})")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in stop):
            raise OptionError("stop", "stop strings must be non-empty")
        (decoder or DecoderConfig()).check_lenience(self.lenience)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise OptionError(name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (alternatives "
                                        f"per token), got {value!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise OptionError("n", f"n must be an integer in [1, {MAX_CHOICES}] (choices per prompt), got {self.n!r}")
        return dataclasses.replace(self, max_new_tokens=int(self.max_new_tokens), sampling=sampling, stop=tuple(stop),
                                   lenience=float(self.lenience), n=int(self.n),
                                   logprobs=None if self.logprobs is None else int(self.logprobs),
                                   prompt_logprobs=None if self.prompt_logprobs is None else int(self.prompt_logprobs))
