"""The one decoding loop, batch-first: every path (a prompt, a stream, a list, a benchmark, a
server request) is a request that joins the running batch and leaves it when done (DESIGN.md §2).

One step, for all running rows at once:
    1 plan      γ per row: its schedule, its guard, clipped to the room it has left
    2 propose   the proposer drafts up to γ tokens per row, with the q they were sampled from
    3 score     ONE target forward over every row's pending token(s) and drafts → p_1..p_{k+1}
    4 accept    per row, with its own generator: the speculative sampling rule (paper §2.3)
    5 commit    per row, token by token through its stops; both caches rolled back to exactly
                the committed prefix (rule 5)
    6 record    per-row statistics; finished rows leave, waiting requests join

Plain decoding is the same loop with no proposer (every γ is 0), so the baseline and the
speculative run differ only in speculation. A row never depends on its neighbours (rule 7): it
draws from its own generator in the same order and number as alone, its γ plan and guard look
only at its own tokens, and its stops are its own. (With a neural model, a batch changes float
rounding slightly — padded shapes — as any batched inference does; table models are exact.)

A request joining the batch reads its prompt in its first step's forward (the other rows' feeds
are padded to the prompt's length in that one call).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from specdecode.engine.cost import BatchCostModel
from specdecode.engine.output import Output
from specdecode.engine.policy import GammaPolicy
from specdecode.engine.request import (ACCEPTED, BONUS, CORRECTED, TARGET, DecodeConfig, GenerationResult,
                                       Request, TokenEvent)
from specdecode.engine.stats import GenerationStats
from specdecode.proposers.base import Draft, no_draft
from specdecode.sampling import SamplingParams, adjust, make_generator, sample
from specdecode.verify import block_step, greedy_lenient_step, speculative_step, tree_step


@dataclass
class StepOutput:
    """What one request got from one step: its new tokens, the step's drafts verified and accepted
    (as counted in its stats: rule 4), its running statistics, and its result once it finished."""

    request_id: int
    events: list[TokenEvent]
    result: GenerationResult | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    stats: GenerationStats | None = None


class _Row:
    """One running request's state. `tokens` is its committed sequence (prompt + emitted);
    the target's cache holds all of it but `pending`, which the next forward feeds first."""

    def __init__(self, request_id: int, request: Request, tokenizer, speculative: bool, device):
        config = request.config
        self.request_id, self.request, self.config = request_id, request, config
        self.sampling: SamplingParams = config.sampling
        self.generator = make_generator(config.sampling.seed, device)
        self.tokens = list(request.prompt_ids)
        self.pending = list(request.prompt_ids)
        self.out = Output(config, tokenizer, self.tokens)
        self.policy = GammaPolicy(config, speculative)
        self.stats = GenerationStats(lossy=config.lenience < 1.0 and speculative,
                                     accepted_per_position=[0] * self.policy.k_max)
        self.start = time.perf_counter()

    def result(self) -> GenerationResult:
        self.stats.num_generated = len(self.out.token_ids)
        self.stats.wall_time_s = time.perf_counter() - self.start
        if self.policy.guard is not None:
            self.stats.num_guard_pauses = self.policy.guard.num_pauses
        return GenerationResult(self.out.text, self.out.token_ids, self.out.finish_reason, self.stats,
                                self.out.origins)


def accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor, config: DecodeConfig,
           generator: torch.Generator) -> tuple[int, int]:
    """Step 4 for one row: (drafts accepted, the next token).

    Args:
        drafts: [k] int64.  draft_probs: [k, V_draft] q (None when k = 0).
        logits: [k+1, V] the target's raw logits after the pending tokens and each draft.
        config: the row's sampling, lenience and verification rule.  generator: the row's.
    """
    k = len(drafts)
    if k > 0 and config.sampling.greedy and config.lenience < 1:
        # lenience must see the target's untempered distribution, not the one-hot (paper A.5)
        n, token = greedy_lenient_step(drafts[None], logits[None], config.lenience)
        return int(n), int(token)
    p = adjust(logits, config.sampling)
    if k > 0:
        # Under greedy decoding (one-hot p and q) the block rule is the token-wise rule exactly
        # (tests/test_block_verify.py), and the token-wise one is cheaper.
        rule = block_step if config.verification == "block" and not config.sampling.greedy else speculative_step
        n, token = rule(drafts[None], draft_probs[None], p[None], generator, config.lenience)
        return int(n), int(token)
    return 0, int(p[0].argmax()) if config.sampling.greedy else int(sample(p[0], generator))


def verify_tree_row(draft: Draft, ids: list[int], logits: torch.Tensor, config: DecodeConfig,
                    generator: torch.Generator, stats: GenerationStats):
    """Step 4 for a row that drafted a token tree (verify.tree_step).

    Args:
        draft: the row's tree (tokens [N], probs [N, V_draft], parents).  ids: its N tokens.
        logits: [N+1, V] the target's raw logits after the pending tokens and after each node.
    Returns:
        (drafts accepted n, new tokens: the path's and the next token, their origins, the path
        of node indices, how many of the draft's chain, which its cache holds, were kept).
    Raises:
        ValueError: lenience < 1 (the tree rule is exact only).
    """
    if config.lenience != 1:
        raise ValueError("token trees are verified exactly: lenience must be 1")
    path, token, rejected = tree_step(draft.tokens, list(draft.parents), draft.probs,
                                      adjust(logits, config.sampling), generator)
    n, chain = len(path), draft.chain
    stats.num_tree_branch_wins += int(path != chain[:n])
    kept_in_chain = next((j for j, node in enumerate(path) if node != chain[j]), n)
    return n, [ids[i] for i in path] + [token], [ACCEPTED] * n + [CORRECTED if rejected else BONUS], path, \
        kept_in_chain


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work, so that the phase timings are true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Continuous batching of requests through one target and one proposer.

    Args:
        target: a backend (specdecode.models) for the target model; the engine owns its rows.
        proposer: a Proposer (specdecode.proposers) or None for plain decoding.
        tokenizer: for text and stop strings; None decodes ids only (text is "").
        max_batch_size: the most rows running at once (None: as many as the backends take);
            further requests wait in order.
        batch_guard: with two or more guarded rows (requests with guard costs), pause their
            drafting on steps where the loop's own timings say a plain step yields more tokens
            per second for the batch (engine.cost). Greedy output is unchanged (exactness holds
            step by step); which steps draft then depends on the batch, so the statistics do.
    Raises:
        ValueError: max_batch_size < 1.
    """

    def __init__(self, target, proposer=None, tokenizer=None, max_batch_size: int | None = None,
                 batch_guard: bool = False):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size!r}")
        self.target, self.proposer, self.tokenizer = target, proposer, tokenizer
        limits = [m for m in (max_batch_size, target.max_rows, getattr(proposer, "max_rows", None)) if m]
        self.capacity = min(limits) if limits else None
        self.device = target.device
        self.running: list[_Row] = []
        self.waiting: deque[tuple[int, Request]] = deque()
        self._next_id = 0
        self.cost = BatchCostModel() if batch_guard and proposer is not None else None
        target.reset()

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, request: Request) -> int:
        """Queue a request; it joins the batch at the next step with room. Returns its id.

        Raises:
            ValueError: an empty prompt.
        """
        if not request.prompt_ids:
            raise ValueError("every prompt needs at least one token")
        request_id = self._next_id
        self._next_id += 1
        self.waiting.append((request_id, request))
        return request_id

    def abort(self, request_id: int) -> GenerationResult | None:
        """Stop a request now (finish_reason "abort"); its row leaves and no other row changes.
        Returns its result so far, or None for an unknown or finished request."""
        for i, (rid, request) in enumerate(self.waiting):
            if rid == request_id:
                del self.waiting[i]
                row = _Row(rid, request, None, False, self.device)
                row.out.finish("abort")
                return row.result()
        for row in self.running:
            if row.request_id == request_id:
                row.out.finish("abort")
                self._leave([row])
                return row.result()
        return None

    def reset(self) -> None:
        """Drop every running and waiting request without results (after a step that raised:
        the caches may hold half of it)."""
        self.running, self.waiting = [], deque()
        self.target.reset()
        if self.proposer is not None:
            self.proposer.select([])

    def step(self) -> list[StepOutput]:
        """One target call for every running row (after admitting waiting requests)."""
        self._admit()
        outputs = {row.request_id: StepOutput(row.request_id, []) for row in self.running}
        limit = self.target.max_length
        full = [row for row in self.running if limit is not None and len(row.tokens) >= limit]
        for row in full:  # the context window is full: no room for another token
            row.out.finish("length")
        self._leave(full, outputs)
        rows = self.running
        if not rows:
            return list(outputs.values())
        # 1 plan
        ks = [row.policy.plan(row.config.max_new_tokens - len(row.out.token_ids), limit, len(row.tokens))
              for row in rows]
        prompt_read = any(len(row.pending) > 1 for row in rows)
        if self.cost is not None:
            ks = self._batch_plan(rows, ks)
        # 2 propose
        synchronize(self.device)
        t0 = time.perf_counter()
        if self.proposer is not None:
            drafts = self.proposer.propose(rows, ks)
        else:
            drafts = [no_draft(self.target.vocab_size, self.device)] * len(rows)
        synchronize(self.device)
        t1 = time.perf_counter()
        # 3 score: one target call over every row's pending token(s) and drafts. A draft id the
        # target cannot embed is fed as 0: the verifier rejects it, and what follows is discarded.
        draft_ids = [d.tokens.tolist() for d in drafts]
        embeddable = self.target.num_embeddings
        feeds = [row.pending + [t if t < embeddable else 0 for t in ids] for row, ids in zip(rows, draft_ids)]
        width = max(len(ids) for ids in draft_ids) + 1
        trees = [d.parents for d in drafts]
        if any(t is not None for t in trees):  # token trees: one call with a tree mask (verify.tree_step)
            logits = self.target.forward(feeds, width, trees)
        else:
            logits = self.target.forward(feeds, width)  # [B, width, V]
        synchronize(self.device)
        t2 = time.perf_counter()
        if self.cost is not None and not prompt_read:  # a prompt read is not a step's cost
            fed = max(len(f) for f in feeds)  # every row is padded to the widest feed
            self.cost.observe_target(len(rows) * fed, fed, t2 - t1)
            self.cost.observe_draft(max(d.forwards for d in drafts), sum(k > 0 for k in ks), t1 - t0)
        # 4 accept and 5 commit, row by row with each row's generator
        accepted, new_tokens, paths = [], [], []
        for b, (row, draft, ids) in enumerate(zip(rows, drafts, draft_ids)):
            k = len(ids)
            if draft.parents is not None:
                n, new, origins, path, n_kept_in_chain = verify_tree_row(
                    draft, ids, logits[b, width - k - 1:], row.config, row.generator, row.stats)
            else:
                n, token = accept(draft.tokens, draft.probs if k else None, logits[b, width - k - 1:], row.config,
                                  row.generator)
                new = ids[:n] + [token]
                origins = [ACCEPTED] * n + [TARGET if k == 0 else BONUS if n == k else CORRECTED]
                path, n_kept_in_chain = None, n
            token = new[-1]
            paths.append(path)
            output = outputs[row.request_id]
            for token_id, origin in zip(new, origins):
                output.events.append(row.out.push(token_id, origin))
                if row.out.finish_reason is not None:
                    break
            # 6 record
            self._record(row, draft, ks[b], n, output, t1 - t0, t2 - t1)
            row.tokens += new
            row.pending = [token]
            accepted.append(n_kept_in_chain)
            new_tokens.append(new)
        if any(t is not None for t in trees):
            self.target.keep_tree_paths(paths)
        self.target.truncate([len(row.tokens) - 1 for row in rows])
        if self.proposer is not None:
            self.proposer.commit(accepted, new_tokens)
        self._leave([row for row in rows if row.out.finish_reason is not None], outputs)
        return list(outputs.values())

    def _batch_plan(self, rows: list[_Row], ks: list[int]) -> list[int]:
        """ks, with every guarded row's γ capped where fewer drafts serve the batch better (engine.cost)."""
        guarded = [row.policy.guard is not None for row in rows]
        if sum(guarded) < 2 or not any(ks) or any(k for k, g in zip(ks, guarded) if not g):
            return ks  # one row's own guard decides; an unguarded drafting row widens the step anyway
        alphas = [row.stats.alpha_estimate if row.stats.num_accepted + row.stats.num_rejected else None
                  for row in rows]
        cap = self.cost.gamma_cap(ks, alphas)
        if cap == max(ks):
            return ks
        for row, k in zip(rows, ks):
            row.stats.num_batch_caps += int(k > cap)
        return [min(k, cap) for k in ks]

    @staticmethod
    def _record(row: _Row, draft: Draft, planned: int, n: int, output: StepOutput, draft_s: float,
                target_s: float) -> None:
        k = len(draft.chain)  # a tree's γ is its chain; its side leaves are extra candidates
        stats = row.stats
        drafted, kept = stats.num_drafted, stats.num_accepted
        stats.num_target_calls += 1
        stats.time_target_s += target_s
        if k:
            stats.time_draft_s += draft_s
        stats.num_draft_calls += draft.forwards
        stats.num_lookup_steps += int(draft.lookup)
        stats.record_step(k, n, len(output.events))
        stats.num_generated = len(row.out.token_ids)
        row.policy.record(planned, k, n, draft.forwards)
        output.num_drafted, output.num_accepted = stats.num_drafted - drafted, stats.num_accepted - kept
        output.stats = stats.snapshot()

    def _admit(self) -> None:
        while self.waiting and (self.capacity is None or len(self.running) < self.capacity):
            request_id, request = self.waiting.popleft()
            encoder_input = request.encoder_input_ids
            self.target.add_row(encoder_input)
            if self.proposer is not None:
                self.proposer.add_row(request.prompt_ids, encoder_input)
            self.running.append(_Row(request_id, request, self.tokenizer, self.proposer is not None, self.device))

    def _leave(self, rows: list[_Row], outputs: dict[int, StepOutput] | None = None) -> None:
        """Finished or aborted rows leave the batch: their cache rows go, so later steps cost less."""
        if not rows:
            return
        gone = {id(row) for row in rows}
        keep = [b for b, row in enumerate(self.running) if id(row) not in gone]
        self.target.select(keep)
        if self.proposer is not None:
            self.proposer.select(keep)
        self.running = [self.running[b] for b in keep]
        if outputs is not None:
            for row in rows:
                outputs[row.request_id].result = row.result()
