"""What a request asks for and what it gets back: the engine's inputs and outputs."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.engine.stats import GenerationStats
from specdecode.sampling import SamplingParams

# Where each emitted token came from (the colours of the paper's Figure 1): a draft token the
# target accepted, the target's correction after a rejection, the bonus token after a fully
# accepted block, and a token of a step that drafted nothing (plain decoding).
ACCEPTED, CORRECTED, BONUS, TARGET = "accepted", "corrected", "bonus", "target"

# How a step's drafts are verified: token by token (paper §2.3) or as a block (Sun et al. 2024).
VERIFICATIONS = ("token", "block", "drafter-invariant")


@dataclass(frozen=True)
class DecodeConfig:
    """How one request is decoded.

    max_new_tokens: at most this many new tokens (>= 1; 0 only with prompt_logprobs: the prompt
        is scored and nothing generated).
    sampling: the request's SamplingParams; its seed gives the request its own generator (rule 7).
    num_speculative_tokens: γ_max, the most drafts per target call; 0 decodes plainly.
    eos_token_ids: tokens that end the output (included in token_ids, not in the text).
    stop: strings that end the output (excluded from the text, also when they span tokens).
    lenience: 1 is exact; l < 1 is the lossy rule of paper A.5 (stats.lossy).
    costs: (c, verify slope[, verify base]) in target calls for the guard (engine.guard, Cor.
        3.9): pause drafting and price free drafts by what they pay; None speculates on every step.
    gamma_schedule: "fixed" drafts up to γ_max every step; "adaptive" starts at min(4, γ_max),
        adds 2 after a block whose planned drafts were all accepted and drops 1 otherwise
        (within [1, γ_max]). Any rule that looks only at the past is exact (§2.3 holds step by step).
    logprobs: None, or N in [0, 20]: every emitted token gets its log-probability under the
        target's raw distribution and the N most likely alternatives (TokenLogprob).
    prompt_logprobs: None, or N in [0, 20]: each prompt token after the first gets its
        log-probability under the target's raw distribution given the tokens before it, with the
        N most likely alternatives (GenerationResult.prompt_logprobs; one extra target forward
        of the prompt, decoder-only targets).
    logits_processors: transformers-style processors (specdecode.processors.ProcessorList).
    grammar: a specdecode.grammar.Grammar the output must follow, or None.
    verification: "token" checks the drafts one by one (paper §2.3, verify.speculative_step);
        "block" verifies the block jointly (Sun et al. 2024, verify.block_step): exact too, and
        never fewer accepted drafts in expectation; "drafter-invariant" samples each token by the
        exponential race with noise keyed by the seed and its position and keeps the drafts equal
        to it (verify.drafter_invariant_step): exact, and the same tokens with or without
        speculation. Greedy decoding is the same under all three.
    Raises:
        ValueError: an unknown verification, or lenience < 1 with "block" or "drafter-invariant"
            (they have no lossy form).
    """

    max_new_tokens: int
    sampling: SamplingParams
    num_speculative_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    lenience: float = 1.0
    costs: tuple[float, ...] | None = None
    gamma_schedule: str = "fixed"
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logits_processors: tuple = ()
    grammar: object = None
    verification: str = "token"

    def __post_init__(self):
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {self.verification!r}")
        if self.verification != "token" and self.lenience != 1:
            raise ValueError(f"lenience {self.lenience} (lossy) works with verification='token' only; "
                             f"{self.verification} verification is exact")


@dataclass(frozen=True)
class Request:
    """One generation: the prompt ids (verbatim; for an encoder–decoder model the decoder prompt,
    [decoder_start_token_id]), how to decode, and an encoder–decoder model's encoder input."""

    prompt_ids: tuple[int, ...] | list[int]
    config: DecodeConfig
    encoder_input_ids: tuple[int, ...] | list[int] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's RAW distribution: log-softmax of
    the target's logits at its position, before penalties, logits processors, grammar masks,
    temperature, top-k, top-p and min-p (natural log, float). `top`: the N most likely ids at
    that position and their log-probabilities, most likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token, as streamed: its id, the text it releases (stop strings may hold text
    back), where it came from, its TokenLogprob when the request asked for logprobs, and where
    its own text starts in the output, in characters (text_offset; a token that starts at or
    after the end of a stopped output's text is not part of it)."""

    token_id: int
    text: str
    origin: str
    logprob: TokenLogprob | None = None
    text_offset: int = 0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended the output is included)
    finish_reason: str    # "stop" | "length" | "eos" | "abort"
    stats: GenerationStats
    origins: list[str]    # per token: accepted | corrected | bonus | target
    # logprobs and text_offsets list the first num_returned_tokens of token_ids: those whose text
    # starts before a stop string's cut (all of them otherwise; Output.num_returned_tokens)
    logprobs: list[TokenLogprob] | None = None  # per returned token, when the request asked for them
    text_offsets: list[int] | None = None  # per returned token: where its text starts in `text`'s characters
    num_returned_tokens: int | None = None  # of token_ids, those listed (as every response lists them)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), when asked

    def to_dict(self) -> dict:
        record = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                  "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            record["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.prompt_logprobs is not None:
            record["prompt_logprobs"] = [None if e is None else e.to_dict() for e in self.prompt_logprobs]
        return record
