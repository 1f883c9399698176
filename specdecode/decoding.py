"""The decoding loop: plain decoding (no proposer) and speculative decoding share it, so the
baseline and the speculative run differ only in speculation (DESIGN.md §2).

One step: 1 propose k drafts → 2 score all of them with one target call → 3 accept a prefix and
sample one token (verify.speculative_step) → 4 commit token by token through the stop checks and
roll both caches back to the committed prefix → 5 record statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specdecode.engine.guard import SpeculationGuard
from specdecode.sampling import SamplingParams, adjust, make_generator, sample
from specdecode.engine.text import IncrementalDetokenizer, StopStrings
from specdecode.verify import greedy_lenient_step, speculative_step

# Where each emitted token came from (the colours of the paper's Figure 1).
ACCEPTED, CORRECTED, BONUS, TARGET = "accepted", "corrected", "bonus", "target"


@dataclass
class GenerationStats:
    """What one generation did (DESIGN.md §6). Times in seconds."""

    num_target_calls: int = 0
    num_draft_calls: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_rejected: int = 0  # blocks that ended in a rejection (a verified draft not accepted)
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated: int = 0
    wall_time_s: float = 0.0
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    lossy: bool = False

    def record_step(self, k: int, n: int, emitted: int) -> None:
        """One verify step: k drafted, n accepted, `emitted` tokens of the block returned. A stop
        on an accepted draft ends the block there: the drafts after it are not counted (rule 4)."""
        kept = min(n, emitted)
        self.num_drafted += emitted if emitted <= n else k
        self.num_accepted += kept
        self.num_rejected += int(n < k and emitted > n)
        for i in range(kept):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (the empirical α); NaN when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else float("nan")

    @property
    def alpha_estimate(self) -> float:
        """Accepted / (accepted + rejected): the fraction of verified drafts that were accepted,
        the per-token acceptance probability α of paper Def. 3.1 (drafts after a rejection were
        never verified, so accepted / drafted underestimates α: at α = 0.8 and γ = 4 it gives
        0.59). NaN when nothing was verified."""
        verified = self.num_accepted + self.num_rejected
        return self.num_accepted / verified if verified else float("nan")

    @property
    def mean_tokens_per_call(self) -> float:
        """Emitted tokens per target call; Eq. 1 of the paper predicts it (1.0 for plain decoding)."""
        return self.num_generated / self.num_target_calls if self.num_target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.wall_time_s if self.wall_time_s else 0.0

    def to_dict(self) -> dict:
        return {
            "num_target_calls": self.num_target_calls, "num_draft_calls": self.num_draft_calls,
            "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
            "num_rejected": self.num_rejected,
            "acceptance_rate": None if not self.num_drafted else self.acceptance_rate,
            "alpha_estimate": None if not self.num_accepted + self.num_rejected else self.alpha_estimate,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_tokens_per_call": self.mean_tokens_per_call, "num_generated": self.num_generated,
            "wall_time_s": self.wall_time_s, "time_draft_s": self.time_draft_s,
            "time_target_s": self.time_target_s, "tokens_per_second": self.tokens_per_second,
            "lossy": self.lossy,
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended the output is included)
    finish_reason: str    # "stop" | "length" | "eos"
    stats: GenerationStats
    origins: list[str]    # per token: accepted | corrected | bonus | target

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token, as streamed: its id, the text it completes, where it came from."""

    token_id: int
    text: str
    origin: str


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int
    sampling: SamplingParams
    num_speculative_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    lenience: float = 1.0  # 1 is exact; l < 1 is the lossy rule of paper A.5 (stats.lossy)
    # (c, verify slope) in target calls: pause drafting while it does not pay
    # (specdecode.engine.guard, Cor. 3.9); None speculates on every step.
    costs: tuple[float, float] | None = None
    # γ per step: "fixed" drafts up to num_speculative_tokens every step; "adaptive" starts at
    # min(4, γ_max), adds 2 after a block whose planned drafts were all accepted and drops 1
    # otherwise (within [1, γ_max]). Any rule that looks only at the past is exact (§2.3 holds
    # step by step).
    gamma_schedule: str = "fixed"


class _Output:
    """Step 4's token-by-token commit: EOS, stop strings, max_new_tokens (DESIGN.md rule 4)."""

    def __init__(self, config: DecodeConfig, tokenizer, prompt_ids: list[int]):
        self.config = config
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stops = StopStrings(list(config.stop)) if config.stop else None
        self.token_ids: list[int] = []
        self.origins: list[str] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None

    def push(self, token_id: int, origin: str) -> TokenEvent:
        self.token_ids.append(token_id)
        self.origins.append(origin)
        is_eos = token_id in self.config.eos_token_ids
        text = self.detok.push(token_id) if self.detok is not None and not is_eos else ""
        if is_eos:
            self.finish_reason = "eos"
        if self.stops is not None:
            text, stopped = self.stops.push(text)
            if stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.token_ids) >= self.config.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason in ("eos", "length"):
            text += self._flush()
        self.text_parts.append(text)
        return TokenEvent(token_id, text, origin)

    def _flush(self) -> str:
        text = self.detok.flush() if self.detok is not None else ""
        if self.stops is not None:
            text, _ = self.stops.push(text)
            text += self.stops.flush()
        return text


def _clip_gamma(k: int, tokens_left: int, max_length: int | None, committed: int) -> int:
    """γ for this step: the block (k drafts + 1 token) must fit max_new_tokens and, since it may
    end with a bonus token, the context window exactly as plain decoding would (rule 4)."""
    k = min(k, tokens_left - 1)
    if max_length is not None:
        k = min(k, max_length - committed - 1)
    return k


def accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor, config: DecodeConfig,
           generator: torch.Generator) -> tuple[int, int]:
    """Step 3 for one sequence: (drafts accepted, the next token). Shared by the single-sequence
    and the batched loops so they draw from the generator identically.

    Args:
        drafts: [k] int64.  draft_probs: [k, V_draft] q (None when k = 0).
        logits: [k+1, V] the target's raw logits after the pending tokens and each draft.
    """
    k = len(drafts)
    if k > 0 and config.sampling.greedy and config.lenience < 1:
        # lenience must see the target's untempered distribution, not the one-hot (paper A.5)
        n, token = greedy_lenient_step(drafts[None], logits[None], config.lenience)
        return int(n), int(token)
    p = adjust(logits, config.sampling)
    if k > 0:
        n, token = speculative_step(drafts[None], draft_probs[None], p[None], generator, config.lenience)
        return int(n), int(token)
    return 0, int(p[0].argmax()) if config.sampling.greedy else int(sample(p[0], generator))


def decode(target, proposer, prompt_ids: list[int], config: DecodeConfig, tokenizer=None,
           ) -> Iterator[TokenEvent]:
    """Generate from `target`, speculating with `proposer` (None: plain decoding).

    A generator of TokenEvents; its return value (StopIteration.value) is the GenerationResult.
    The target's cache holds the committed sequence minus the pending tokens (at first the whole
    prompt, then the last sampled token), which are fed with the next step's drafts: each step
    is exactly one target call, whose last k+1 positions give p_1..p_{k+1} (paper §2.3).

    Args:
        target: a backend (specdecode.models).  proposer: a Proposer or None.
        prompt_ids: non-empty list of token ids.  config: limits, sampling, k, stops.
        tokenizer: for text and stop strings; None decodes ids only (text is "").
    """
    start = time.perf_counter()
    generator = make_generator(config.sampling.seed)
    stats = GenerationStats(lossy=config.lenience < 1.0 and proposer is not None)
    out = _Output(config, tokenizer, prompt_ids)
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    k_max = config.num_speculative_tokens if proposer is not None else 0
    adaptive = config.gamma_schedule == "adaptive"
    k_step = min(4, k_max) if adaptive else k_max
    stats.accepted_per_position = [0] * k_max

    target.reset()
    if proposer is not None:
        proposer.configure(config.sampling, generator)
        proposer.start(prompt)
    guard = None
    if config.costs is not None and proposer is not None:
        guard = SpeculationGuard(*config.costs)
    pending = prompt
    committed = len(prompt_ids)
    while out.finish_reason is None:
        if target.max_length is not None and committed >= target.max_length:
            out.finish_reason = "length"
            break
        k = k_step if guard is None or guard.speculate() else 0
        k = planned = _clip_gamma(k, config.max_new_tokens - len(out.token_ids), target.max_length, committed)
        # 1 propose
        draft_calls = proposer.num_calls if proposer is not None else 0
        if k > 0:
            draft = proposer.propose(k)
            drafts = draft.tokens
            k = len(drafts)  # a proposer may stop early (dynamic γ)
        else:
            drafts = prompt[:0]
        # 2 score: one target call over the pending token(s) and the k drafts. A draft id beyond
        # the target's vocabulary (a larger draft embedding table) is fed as 0: the verifier
        # rejects it anyway, and the positions after it are discarded.
        t0 = time.perf_counter()
        fed = torch.where(drafts < target.vocab_size, drafts, 0)
        logits = target.forward(torch.cat([pending, fed]), k + 1)  # [k+1, V]
        stats.time_target_s += time.perf_counter() - t0
        stats.num_target_calls += 1
        # 3 accept
        n, token = accept(drafts, draft.probs if k > 0 else None, logits, config, generator)
        # 4 commit, token by token, until a stop
        new_tokens = drafts[:n].tolist() + [token]
        origins = [ACCEPTED] * n + [TARGET if k == 0 else BONUS if n == k else CORRECTED]
        pushed = 0
        for token_id, origin in zip(new_tokens, origins):
            yield out.push(token_id, origin)
            pushed += 1
            if out.finish_reason is not None:
                break
        # 5 record
        stats.record_step(k, n, pushed)
        if adaptive and planned > 0:  # a block cut short by the draft's own doubt counts as a miss
            k_step = min(k_max, k_step + 2) if n == planned else max(1, k_step - 1)
        if guard is not None and k > 0:
            guard.record(k, proposer.num_calls - draft_calls, n + 1)
        target.truncate(committed + n)
        if proposer is not None:
            proposer.commit(n, new_tokens)
        pending = torch.tensor([token], dtype=torch.long)
        committed += n + 1

    if proposer is not None:
        stats.num_draft_calls = proposer.num_calls
        stats.time_draft_s = proposer.time_s
    stats.num_generated = len(out.token_ids)
    stats.wall_time_s = time.perf_counter() - start
    return GenerationResult("".join(out.text_parts), out.token_ids, out.finish_reason, stats, out.origins)


def run(target, proposer, prompt_ids: list[int], config: DecodeConfig, tokenizer=None) -> GenerationResult:
    """decode() to the end; returns the GenerationResult."""
    events = decode(target, proposer, prompt_ids, config, tokenizer)
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value
