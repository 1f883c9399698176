"""Per-request logits transforms that depend on the prefix: penalties, user logits processors and
grammar masks (docs/exactness.md rule 9).

A request's `LogitsPipeline` turns the raw logits of a position into the logits it really samples
from, before `sampling.adjust` (temperature, top-k, top-p, min-p). Speculative decoding stays
exact only if the target's p_i and the draft's q_i at drafted position i are that distribution
with the prefix *committed tokens + drafts before i* (paper §2.3 holds position by position), so
every transform is called as `transform(committed, drafts, logits, start)`: row i of `logits`
[n, V] is the position after `committed + drafts[:start + i]` (the target scores start = 0 and
n = k + 1; the draft scores one position at a time, start = drafts so far). Nothing learnt from a draft may outlive the call: a
transform is a function of the prefix (it may cache what it learnt from committed tokens, which
never change, but must forget the drafts before returning).

Order (the same on both sides): repetition penalty, presence/frequency penalties, logit_bias, the
min_tokens EOS mask, the request's logits processors in order, the grammar mask.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Callable, Protocol, Sequence

import torch


class Transform(Protocol):
    def __call__(self, committed: Sequence[int], drafts: Sequence[int], logits: torch.Tensor,
                 start: int = 0) -> torch.Tensor:
        """logits [n, V] float32 (start + n <= len(drafts) + 1), row i after committed +
        drafts[:start + i] → the same shape (logits changed in place, or a new tensor)."""


class Penalties:
    """repetition_penalty with transformers' semantics (RepetitionPenaltyLogitsProcessor: every id
    in the prefix, prompt included, has its logit divided by the penalty if positive, multiplied
    if negative), then OpenAI's presence and frequency penalties over the generated tokens only
    (logit −= frequency × count + presence × [count > 0]).

    Sparse: only the ids in the prefix are touched (a prefix holds hundreds of distinct ids, the
    vocabulary 150k). Keeps the ids and counts of the committed tokens (they only grow) and adds
    each call's drafts on copies. Changes `logits` in place.

    Args:
        repetition: > 0 (1 = off).  presence, frequency: in [-2, 2] (0 = off).
        prompt_len: the committed tokens before this many are the prompt (not "generated").
        vocab_size: V, the width of the logits.
    """

    def __init__(self, repetition: float, presence: float, frequency: float, prompt_len: int, vocab_size: int):
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        self.prompt_len, self.vocab_size = prompt_len, vocab_size
        self._seen = 0
        self._in_prefix: set[int] = set()        # ids anywhere in the committed prefix
        self._generated: Counter[int] = Counter()  # counts of committed generated ids

    def _sync(self, committed: Sequence[int]) -> None:
        for i in range(self._seen, len(committed)):
            token = committed[i]
            if 0 <= token < self.vocab_size:
                self._in_prefix.add(token)
                if i >= self.prompt_len:
                    self._generated[token] += 1
        self._seen = max(self._seen, len(committed))

    def __call__(self, committed, drafts, logits, start: int = 0):
        self._sync(committed)
        n, vocab = logits.shape
        present, counts = set(self._in_prefix), Counter(self._generated)
        for token in drafts[:start]:  # the drafts before row 0 (the draft side), on copies
            if 0 <= token < vocab:
                present.add(token)
                counts[token] += 1
        for i in range(n):
            if i:
                token = drafts[start + i - 1]
                if 0 <= token < vocab:
                    present.add(token)
                    counts[token] += 1
            row = logits[i]
            if self.repetition != 1.0 and present:
                index = torch.tensor(sorted(present), device=logits.device)
                values = row[index]
                row[index] = torch.where(values < 0, values * self.repetition, values / self.repetition)
            if (self.presence or self.frequency) and counts:
                ids = sorted(counts)
                index = torch.tensor(ids, device=logits.device)
                count = torch.tensor([counts[t] for t in ids], dtype=row.dtype, device=logits.device)
                row[index] -= self.frequency * count + self.presence
        return logits


class LogitBias:
    """OpenAI's logit_bias: a fixed vector added to every position's logits (it does not depend
    on the prefix, but must reach p and q alike, so it is a pipeline step).

    Args:
        bias: {token id: bias}.  vocab_size: V.
    Raises:
        ValueError: a token id outside [0, V).
    """

    def __init__(self, bias: dict[int, float], vocab_size: int):
        outside = [t for t in bias if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
        self.ids = torch.tensor(sorted(bias), dtype=torch.long)
        self.values = torch.tensor([bias[t] for t in sorted(bias)], dtype=torch.float32)

    def __call__(self, committed, drafts, logits, start: int = 0):
        if self.ids.device != logits.device:
            self.ids, self.values = self.ids.to(logits.device), self.values.to(logits.device)
        logits[:, self.ids] += self.values
        return logits


class MinTokens:
    """The EOS ids masked (−inf) at every position before the min_tokens-th generated token.

    Args:
        min_tokens: the output's least length.  eos_token_ids: the ids masked.
        prompt_len: the committed tokens before this many are the prompt.
    """

    def __init__(self, min_tokens: int, eos_token_ids, prompt_len: int, vocab_size: int):
        self.min_tokens, self.prompt_len = min_tokens, prompt_len
        self.ids = torch.tensor(sorted(t for t in eos_token_ids if 0 <= t < vocab_size), dtype=torch.long)

    def __call__(self, committed, drafts, logits, start: int = 0):
        # row i scores the token generated after len(committed) + start + i - prompt_len others
        before = len(committed) + start - self.prompt_len
        rows = max(0, min(logits.shape[0], self.min_tokens - before))
        if rows and len(self.ids):
            logits[:rows, self.ids.to(logits.device)] = float("-inf")
        return logits


class ProcessorList:
    """Logits processors with transformers' LogitsProcessor signature, `processor(input_ids [1, T]
    int64, scores [1, V] float32) -> scores [1, V]`, called once per position with that position's
    whole prefix (prompt included) in order.

    A processor must be a function of (input_ids, scores): it is called for drafted positions that
    may be rejected, for the target's positions and the draft's, and for one position more than
    once. Hidden state that changes with the calls breaks exactness unless it is rebuilt from
    input_ids (or rolled back) each time.
    """

    def __init__(self, processors: Sequence[Callable]):
        self.processors = list(processors)

    def __call__(self, committed, drafts, logits, start: int = 0):
        n = logits.shape[0]
        ids = torch.tensor(list(committed) + list(drafts[:start + n - 1]), dtype=torch.long, device=logits.device)
        rows = []
        for i in range(n):
            scores = logits[i:i + 1].clone()
            prefix = ids[:len(committed) + start + i][None]
            for processor in self.processors:
                scores = processor(prefix, scores)
            rows.append(scores[0])
        return torch.stack(rows)


class LogitsPipeline:
    """One request's transforms, applied in order (see the module docstring).

    Args:
        transforms: Transform callables; an optional `grammar` (specdecode.grammar.GrammarState)
            goes last and also serves `valid_prefix` and `forced`.
        vocab_size: V of the target's logits; the draft's logits are padded or cut to it.
    """

    def __init__(self, transforms: list[Transform], vocab_size: int, grammar=None):
        self.transforms = list(transforms) + ([grammar] if grammar is not None else [])
        self.vocab_size = vocab_size
        self.grammar = grammar
        # the last exception its transforms raised: a step that fails with it is this request's
        # fault alone (the engine names the request: Engine.culprit)
        self.error: Exception | None = None

    def __call__(self, committed: Sequence[int], drafts: Sequence[int], logits: torch.Tensor,
                 start: int = 0) -> torch.Tensor:
        """logits [n, V'] any float dtype, row i after committed + drafts[:start + i] → [n, V]
        float32 (V' < V padded with -inf, V' > V cut)."""
        logits = logits.float()
        width = logits.shape[-1]
        if width < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        else:  # a copy: transforms change it in place, and the raw logits still serve logprobs
            logits = logits[..., :self.vocab_size].clone()
        with self._blamed():
            for transform in self.transforms:
                logits = transform(committed, drafts, logits, start)
        return logits

    def valid_prefix(self, committed: Sequence[int], drafts: Sequence[int]) -> int:
        """How many of the drafts the grammar allows in a row (all of them without a grammar)."""
        with self._blamed():
            return len(drafts) if self.grammar is None else self.grammar.valid_prefix(committed, drafts)

    def forced(self, committed: Sequence[int], drafts: Sequence[int]) -> int | None:
        """The one token the grammar allows after committed + drafts, or None (several, or no
        grammar), or specdecode.grammar.ENDED (-1) once it has taken its stop token."""
        with self._blamed():
            return None if self.grammar is None else self.grammar.forced(committed, drafts)

    @contextmanager
    def _blamed(self):
        """Record an exception of the transforms as this pipeline's (an interrupt is nobody's)."""
        try:
            yield
        except Exception as err:
            self.error = err
            raise


def build_pipeline(sampling, prompt_len: int, vocab_size: int, logits_processors: Sequence[Callable] = (),
                   grammar=None, eos_token_ids=()) -> LogitsPipeline | None:
    """The pipeline of one request, or None when nothing shapes its logits (the fast path).

    Args:
        sampling: its SamplingParams (penalties, logit_bias, min_tokens).  prompt_len: tokens of
            the committed prefix that are prompt.  vocab_size: V of the target's logits.
            logits_processors: transformers-style processors.  grammar: a
            specdecode.grammar.Grammar or None.  eos_token_ids: what min_tokens masks.
    Raises:
        ValueError: a logit_bias id outside the vocabulary.
    """
    transforms: list[Transform] = []
    if sampling.has_penalties:
        transforms.append(Penalties(sampling.repetition_penalty, sampling.presence_penalty,
                                    sampling.frequency_penalty, prompt_len, vocab_size))
    if sampling.logit_bias:
        transforms.append(LogitBias(sampling.logit_bias, vocab_size))
    if sampling.min_tokens and eos_token_ids:
        transforms.append(MinTokens(sampling.min_tokens, eos_token_ids, prompt_len, vocab_size))
    if logits_processors:
        transforms.append(ProcessorList(logits_processors))
    state = grammar.state(prompt_len) if grammar is not None else None
    if not transforms and state is None:
        return None
    return LogitsPipeline(transforms, vocab_size, state)
