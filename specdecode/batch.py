"""Speculative decoding of B prompts together, each row accepting its own number of tokens.

Per step, for the whole batch: γ_max draft forwards (one per drafted position), one target
forward over every row's pending token(s) and drafts, then the verify rule (paper §2.3,
Algorithm 1) row by row. Rows are ragged: prompts differ in length, rows accept different
numbers of drafts, and rows finish at different steps. The batched backends
(specdecode.models.HFBatchedCausalLM, BatchedTableModel) take one token list per row, pad on
the left of each step's block, mask padding and rolled-back slots, and give each row position
ids that count only its own tokens (see models/hf_batch.py).

Each row is exactly what it would be alone (decoding.decode with a DraftModelProposer):
- it has its own torch.Generator from its own seed, and draws from it in the same order and
  number as the single-sequence loop (its own γ per step, its own draft samples, then k
  uniforms and one sample in speculative_step), so a row never depends on its neighbours
  (DESIGN.md rule 7);
- its γ is clipped per step exactly as alone (max_new_tokens, both context windows), and its
  dynamic γ (draft_confidence) stops its drafting alone; a row with fewer drafts than the batch
  simply feeds nothing (padding) at the later draft positions;
- its logits are adjusted by its own SamplingParams, and it commits token by token through its
  own EOS, stop strings and max_new_tokens (rule 4). A finished row leaves the batch.

Not done in batch mode: prompt lookup (the draft model proposes every step; lookup-only
decoding falls back to one prompt at a time in SpeculativeDecoder.generate) and streaming.
Lenience (lossy, paper A.5) is per row, from its DecodeConfig. With a neural model, batching changes
float rounding slightly (padded shapes), as any batched inference does; table models are exact.

Statistics are per row: target and draft calls are the forwards the row took part in with
tokens of its own; time_target_s / time_draft_s are the whole batch's time in those steps (the
row waited for it); wall_time_s runs from the batch's start to the row's finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.decoding import (ACCEPTED, BONUS, CORRECTED, TARGET, DecodeConfig, GenerationResult,
                                 GenerationStats, _clip_gamma, _Output, accept)
from specdecode.sampling import SamplingParams, adjust, make_generator, sample


@dataclass
class _Row:
    """One request's state; `committed` counts prompt + emitted tokens (as in decoding.decode)."""

    config: DecodeConfig
    out: _Output
    generator: torch.Generator
    stats: GenerationStats
    pending: list[int]                 # committed tokens the target has not been fed yet
    draft_pending: list[int]           # the same for the draft
    committed: int
    k: int = 0                         # drafts this step
    draft_base: int = 0                # draft cache length + draft_pending at proposal time
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)

    @property
    def sampling(self) -> SamplingParams:
        return self.config.sampling

    def draw(self, probs: torch.Tensor) -> int:
        """One token from probs [V] with the row's generator (argmax when greedy)."""
        return int(probs.argmax()) if self.sampling.greedy else int(sample(probs, self.generator))


def decode_batch(target, draft, prompts: list[list[int]], configs: list[DecodeConfig], tokenizer=None,
                 draft_confidence: float = 0.0) -> list[GenerationResult]:
    """Generate a continuation of every prompt, all rows in one batch (see module docstring).

    Args:
        target: a batched backend for the target model (HFBatchedCausalLM, BatchedTableModel).
        draft: a batched backend for the draft model, or None for plain batched decoding.
        prompts: B non-empty lists of token ids, any lengths.
        configs: B DecodeConfigs (limits, sampling with each row's seed, γ, EOS, stops).
        tokenizer: for text and stop strings; None decodes ids only (text is "").
        draft_confidence: dynamic γ as in DraftModelProposer, in [0, 1); 0 drafts γ tokens.
    Returns:
        B GenerationResults in prompt order, each with its own stats.
    Raises:
        ValueError: prompts and configs differ in number, or a prompt is empty.
    """
    if len(prompts) != len(configs) or not prompts:
        raise ValueError(f"need one DecodeConfig per prompt, got {len(prompts)} prompts and {len(configs)} configs")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    start = time.perf_counter()
    rows = [_new_row(list(p), c, tokenizer, draft) for p, c in zip(prompts, configs)]
    target.start(len(rows))
    if draft is not None:
        draft.start(len(rows))
    active = list(rows)
    while active:
        for row in active:
            if target.max_length is not None and row.committed >= target.max_length:
                row.out.finish_reason = "length"
        active = _drop_finished(active, target, draft, start)
        if not active:
            break
        for row in active:
            row.k = _gamma(row, target, draft)
        # 1 propose
        t0 = time.perf_counter()
        _propose(active, draft, draft_confidence)
        t1 = time.perf_counter()
        # 2 score: one target forward for the batch
        logits = _score(active, target)
        t2 = time.perf_counter()
        for b, row in enumerate(active):
            row.stats.time_draft_s += t1 - t0 if row.drafts else 0.0
            row.stats.time_target_s += t2 - t1
            # 3 accept, 4 commit, 5 record: per row, with its own generator
            _accept_and_commit(row, logits[b, logits.shape[1] - row.k - 1:])
        target.truncate([row.committed - 1 for row in active])
        if draft is not None:
            draft.truncate([row.draft_base for row in active])
        active = _drop_finished(active, target, draft, start)
    return [_result(row) for row in rows]


def _new_row(prompt: list[int], config: DecodeConfig, tokenizer, draft) -> _Row:
    k_max = config.num_speculative_tokens if draft is not None else 0
    stats = GenerationStats(lossy=config.lenience < 1.0 and draft is not None, accepted_per_position=[0] * k_max)
    return _Row(config=config, out=_Output(config, tokenizer, prompt), generator=make_generator(config.sampling.seed),
                stats=stats, pending=prompt, draft_pending=list(prompt), committed=len(prompt))


def _gamma(row: _Row, target, draft) -> int:
    """γ for this row and step, clipped as decoding.decode and DraftModelProposer.propose clip it."""
    if draft is None:
        return 0
    k = _clip_gamma(row.config.num_speculative_tokens, row.config.max_new_tokens - len(row.out.token_ids),
                    target.max_length, row.committed)
    if k > 0 and draft.max_length is not None:
        # the draft's cache will hold the committed prefix and k − 1 drafts
        k = min(k, draft.max_length - row.committed + 1)
    return max(k, 0)


def _propose(active: list[_Row], draft, confidence: float) -> None:
    """Draft up to row.k tokens per row: forward j feeds each row that still drafts its pending
    tokens (j = 0) or its previous draft; the others feed nothing."""
    for row in active:
        row.drafts, row.q = [], []
    if draft is None:
        return
    lengths = draft.lengths
    for b, row in enumerate(active):
        # where the draft's cache of this row will be rolled back to (plus accepted drafts)
        row.draft_base = int(lengths[b]) + (len(row.draft_pending) if row.k > 0 else 0)
    for j in range(max(row.k for row in active)):
        if all(j >= row.k for row in active):  # every row stopped early (dynamic γ)
            break
        feeds = [(row.draft_pending if j == 0 else row.drafts[-1:]) if j < row.k else [] for row in active]
        logits = draft.forward(feeds, 1)[:, 0]  # [B, V]
        for b, row in enumerate(active):
            if j >= row.k:
                continue
            row.stats.num_draft_calls += 1
            q = adjust(logits[b], row.sampling)
            token = row.draw(q)
            row.drafts.append(token)
            row.q.append(q)
            if confidence and len(row.drafts) < row.k and float(torch.softmax(logits[b], -1)[token]) < confidence:
                row.k = len(row.drafts)
    for row in active:
        if row.drafts:
            row.draft_pending = []


def _score(active: list[_Row], target) -> torch.Tensor:
    """[B, max k + 1, V] target logits; row b's p_1..p_{k+1} are its last k_b + 1 entries. A draft id
    beyond the target's vocabulary is fed as 0: the verifier rejects it anyway."""
    feeds = [row.pending + [t if t < target.vocab_size else 0 for t in row.drafts] for row in active]
    return target.forward(feeds, max(row.k for row in active) + 1)


def _accept_and_commit(row: _Row, logits: torch.Tensor) -> None:
    """Algorithm 1's accept step for one row, then its token-by-token commit (decoding.decode's
    steps 3-5, drawing from the row's generator in the same order)."""
    k = row.k
    n, token = accept(torch.tensor(row.drafts, dtype=torch.long), torch.stack(row.q) if k > 0 else None, logits,
                      row.config, row.generator)
    row.stats.num_target_calls += 1
    new_tokens = row.drafts[:n] + [token]
    origins = [ACCEPTED] * n + [TARGET if k == 0 else BONUS if n == k else CORRECTED]
    pushed = 0
    for token_id, origin in zip(new_tokens, origins):
        row.out.push(token_id, origin)
        pushed += 1
        if row.out.finish_reason is not None:
            break
    row.stats.record_step(k, n, pushed)
    # Rollback targets: the target keeps committed + n (the new token is pending); the draft
    # keeps its prefix plus the accepted drafts it was fed (the last draft never was).
    if row.drafts:
        kept = min(n, len(row.drafts) - 1)
        row.draft_pending = new_tokens[kept:]
        row.draft_base += kept
    else:  # the draft sat out this step: its cache did not move, the tokens queue up
        row.draft_pending = row.draft_pending + new_tokens
    row.pending = [token]
    row.committed += n + 1


def _drop_finished(active: list[_Row], target, draft, start: float) -> list[_Row]:
    """Finished rows leave the batch: their cache rows are dropped, so later steps cost less."""
    keep = [b for b, row in enumerate(active) if row.out.finish_reason is None]
    if len(keep) == len(active):
        return active
    now = time.perf_counter()
    for row in active:
        if row.out.finish_reason is not None:
            row.stats.wall_time_s = now - start
    if keep:
        target.select(keep)
        if draft is not None:
            draft.select(keep)
    return [active[b] for b in keep]


def _result(row: _Row) -> GenerationResult:
    row.stats.num_generated = len(row.out.token_ids)
    return GenerationResult("".join(row.out.text_parts), row.out.token_ids, row.out.finish_reason, row.stats,
                            row.out.origins)
