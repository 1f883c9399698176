"""The one decoding loop, batch-first: every path (a prompt, a stream, a list, a benchmark, a
server request) is a request that joins the running batch and leaves it when done (docs/ARCHITECTURE.md).

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

A request that runs alone reads its prompt in its first step's forward (prefill and first verify
in one call); one that joins other rows reads it in a forward of its own when it is admitted, so
no other row's feed is padded to the prompt's length.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from specdecode.engine.cost import BatchCostModel
from specdecode.engine.output import Output
from specdecode.engine.policy import GammaPolicy
from specdecode.engine.request import (ACCEPTED, BONUS, CORRECTED, TARGET, DecodeConfig, GenerationResult,
                                       Request, TokenEvent, TokenLogprob)
from specdecode.engine.stats import GenerationStats
from specdecode.engine.threads import ThreadGovernor
from specdecode.processors import LogitsPipeline, build_pipeline
from specdecode.proposers.base import Draft, no_draft, proposer_reads
from specdecode.sampling import (SamplingParams, adjust, first_argmax, make_generator, race, race_noise, race_seed,
                                 sample)
from specdecode.verify import block_step, drafter_invariant_step, greedy_lenient_step, speculative_step, tree_step



class StepFailed(RuntimeError):
    """A request ended because a step it was in failed for another request's error, or for no
    request's (a backend's): named in the message (Engine.fail)."""

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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first output, when asked


@dataclass
class StepTimes:
    """One step's timings (seconds), for the statistics and the batch cost model: the proposer's
    (draft_s; of it, read_s reading read_tokens committed tokens) and the target call's
    (target_s, over feeds padded to `fed` tokens)."""

    draft_s: float = 0.0
    read_s: float = 0.0
    read_tokens: int = 0
    target_s: float = 0.0
    fed: int = 0


@dataclass
class Verdict:
    """One row's verified step: n drafts accepted, the new tokens emitted (accepted drafts and
    the target's next token) with their origins and logprobs; for a tree, its accepted path and
    how many of those drafts lie on its chain (what the proposer keeps)."""

    n: int
    new: list[int]
    origins: list[str]
    logprobs: list
    path: list[int] | None
    kept_in_chain: int


class _Row:
    """One running request's state. `tokens` is its committed sequence (prompt + emitted);
    the target's cache holds all of it but `pending`, which the next forward feeds first."""

    def __init__(self, request_id: int, request: Request, tokenizer, speculative: bool, device,
                 vocab_size: int | None = None, clock: Callable[[], float] = time.perf_counter):
        config = request.config
        self.request_id, self.request, self.config = request_id, request, config
        self.sampling: SamplingParams = config.sampling
        self.generator = make_generator(config.sampling.seed, device)
        # drafter-invariant rows draw every token by the race with noise keyed by this seed; a
        # proposer that drafts with the same noise is accepted far more often
        self.race_seed = race_seed(self.generator) if config.verification == "drafter-invariant" \
            and not config.sampling.greedy else None
        self.tokens = list(request.prompt_ids)
        self.pending = list(request.prompt_ids)
        self.out = Output(config, tokenizer, self.tokens)
        self.policy = GammaPolicy(config, speculative)
        self.stats = GenerationStats(lossy=config.lenience < 1.0 and speculative,
                                     accepted_per_position=[0] * self.policy.k_max)
        self.clock = clock
        self.start = clock()
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # penalties, logit_bias, min_tokens, processors, grammar: None keeps the fast path
        # (specdecode.processors)
        self.pipeline: LogitsPipeline | None = None
        if vocab_size is not None:
            self.pipeline = build_pipeline(config.sampling, len(request.prompt_ids), vocab_size,
                                           config.logits_processors, config.grammar, config.eos_token_ids)

    def result(self) -> GenerationResult:
        self.stats.num_generated = len(self.out.token_ids)
        self.stats.wall_time_s = self.clock() - self.start
        if self.policy.guard is not None:
            self.stats.num_guard_pauses = self.policy.guard.num_pauses
        self.stats.num_free_declined = self.policy.num_free_declined
        # logprobs and offsets cover exactly the returned text, by the rule the wire formats use
        returned = self.out.num_returned_tokens
        logprobs = self.out.logprobs[:returned] if self.out.logprobs is not None else None
        return GenerationResult(self.out.text, self.out.token_ids, self.out.finish_reason, self.stats,
                                self.out.origins, logprobs, self.out.text_offsets[:returned], returned,
                                self.prompt_logprobs)


def accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor, config: DecodeConfig,
           generator: torch.Generator, committed: list[int], pipeline: LogitsPipeline | None = None
           ) -> tuple[int, int]:
    """Step 4 for one row: (drafts accepted, the next token).

    Args:
        drafts: [k] int64.  draft_probs: [k, V_draft] q (None when k = 0).
        logits: [k+1, V] the target's raw logits after the pending tokens and each draft.
        config: the row's sampling, lenience and verification rule.  generator: the row's.
        committed: the row's committed tokens (prompt + emitted): drafts[i] is at position
            len(committed) + i.
        pipeline: the row's prefix-dependent transforms (rule 9): position i's logits are
            transformed with prefix committed + drafts[:i].
    """
    k = len(drafts)
    if pipeline is not None:
        logits = pipeline(committed, drafts.tolist(), logits)
    if config.sampling.greedy:
        # Greedy verification compares argmaxes; at lenience 1 it is the sampling rule on one-hot
        # p and q, without building [k+1, V] one-hots. Lenience must see the target's
        # untempered distribution, not the one-hot (paper A.5).
        if k == 0:
            return 0, int(first_argmax(logits[0]))
        n, token = greedy_lenient_step(drafts[None], logits[None], config.lenience)
        return int(n), int(token)
    p = adjust(logits, config.sampling)
    if config.verification == "drafter-invariant":
        # each position's token is the race over p with that position's noise (sampling.race_noise)
        seed, start = race_seed(generator), len(committed)
        noise = torch.stack([race_noise(seed, start + i, p.shape[-1]) for i in range(k + 1)]).to(p.device)
        if k == 0:
            return 0, int(race(p[0], noise[0]))
        n, token = drafter_invariant_step(drafts[None], p[None], noise[None])
        return int(n), int(token)
    if k > 0:  # (greedy returned above: there the block rule is the token-wise one, tests/test_block_verify.py)
        rule = block_step if config.verification == "block" else speculative_step
        n, token = rule(drafts[None], draft_probs[None], p[None], generator, config.lenience)
        return int(n), int(token)
    return 0, int(sample(p[0], generator))


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


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the target's raw distribution at its position (the
    log-softmax of the logits, before any processing), with the `top` most likely ids.

    logits: [len(tokens), V] the target's raw logits; row i is the position of tokens[i].
    top: alternatives per token (at most V are given).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    top = min(top, logprobs.shape[-1])  # a vocabulary smaller than the alternatives asked for: all of it
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alternatives) for t, lp, alternatives in zip(tokens, chosen, tops)]


def _cut_to_grammar(row: _Row, draft: Draft) -> Draft:
    """The draft up to the first token its grammar refuses: that token would be rejected (p = 0),
    so it and what follows are cut before the target call, at no cost to exactness. (A row with a
    grammar drafts chains, never trees: DraftModelProposer.)"""
    k = len(draft.tokens)
    if row.pipeline is None or row.pipeline.grammar is None or k == 0 or draft.parents is not None:
        return draft
    n = row.pipeline.valid_prefix(row.tokens, draft.tokens.tolist())
    if n == k:
        return draft
    return dataclasses.replace(draft, tokens=draft.tokens[:n], probs=draft.probs[:n])


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
        batch_guard: time the loop's own steps (engine.cost) and use the timings: every guarded
            row's guard (requests with guard costs) gets its c and slope from them once they are
            known, and with two or more guarded rows their drafting pauses on steps where a plain
            step yields more tokens per second for the batch. Greedy output is unchanged
            (exactness holds step by step); which steps draft then depends on the batch and the
            machine, so the statistics do.
        first_step_plain: a row drafts nothing on its first step, so its first token costs the
            target's prompt read alone, as in plain decoding (the draft reads the prompt on the
            next step); one more target call per request.
        clock: seconds, monotonic (time.perf_counter); the step timings (statistics, the batch
            guard) and each request's wall time read it. Tests pass one they move by hand.
        threads: a ThreadGovernor ticked before every step, None for none, or "auto": one where
            the target is batch-invariant (its bits do not depend on the thread count), so the
            compute runs on fewer threads while other processes keep the cores busy.
        accept_rule: step 4 for one row, `accept`'s signature; tests pass a deliberately wrong one
            (their negative controls) instead of patching this module.
    Raises:
        ValueError: max_batch_size < 1.
    """

    def __init__(self, target, proposer=None, tokenizer=None, max_batch_size: int | None = None,
                 batch_guard: bool = False, first_step_plain: bool = False,
                 clock: Callable[[], float] = time.perf_counter, threads: ThreadGovernor | None | str = "auto",
                 accept_rule: Callable = None):
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
        self.first_step_plain = first_step_plain
        self.clock = clock
        self.accept_rule = accept_rule or accept
        # fewer threads while other processes keep cores busy, only where that changes no bit
        self.threads = (ThreadGovernor() if getattr(target, "batch_invariant", False) else None) \
            if threads == "auto" else threads
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
                row = _Row(rid, request, None, False, self.device, clock=self.clock)
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

    def fail(self, error: BaseException) -> dict[int, BaseException]:
        """After step() raised `error`: what each request in the engine (running or waiting) ends
        with, and the engine reset (its caches may hold half the step). The request whose own
        logits pipeline raised it (culprit) gets `error`; every other a StepFailed naming it (the
        request itself did nothing wrong: a client may retry it). The one rule for every driver."""
        culprit = self.culprit(error)
        ids = [row.request_id for row in self.running] + [request_id for request_id, _ in self.waiting]
        self.reset()
        other = StepFailed(f"a decoding step failed ({type(error).__name__}: {error}); every request running in "
                           "it ended")
        return {request_id: error if request_id == culprit else other for request_id in ids}

    def culprit(self, error: BaseException) -> int | None:
        """After step() raised `error` (before reset()): the id of the running request whose own
        logits pipeline raised it (its processors, its grammar), or None when no one request's
        code did (a backend's error, an interrupt)."""
        return next((row.request_id for row in self.running
                     if row.pipeline is not None and row.pipeline.error is error
                     or getattr(error, "_specdecode_row", None) == row.request_id), None)

    def step(self) -> list[StepOutput]:
        """One target call for every running row (after admitting waiting requests), in the six
        phases of the module docstring.

        Raises:
            what a row's logits pipeline or a backend raises; the caches may then hold half the
            step: reset() before the next (culprit() first names the request at fault, if one is).
        """
        if self.threads is not None:
            self.threads.tick()
        scored = self._admit()
        outputs = {row.request_id: StepOutput(row.request_id, []) for row in self.running}
        for row in scored:  # their first output carries the prompt's logprobs
            outputs[row.request_id] = StepOutput(row.request_id, [], None if row in self.running else row.result(),
                                                 prompt_logprobs=row.prompt_logprobs)
        limit = self.target.max_length
        full = [row for row in self.running if limit is not None and len(row.tokens) >= limit]
        for row in full:  # the context window is full: no room for another token
            row.out.finish("length")
        self._leave(full, outputs)
        rows = self.running
        if not rows:
            return list(outputs.values())
        ks = self._plan(rows)
        prompt_read = any(len(row.pending) > 1 for row in rows)
        drafts, times = self._propose(rows, ks)
        logits = self._score(rows, drafts, times)
        if self.cost is not None and not prompt_read:  # a prompt read is not a step's cost
            self._observe_costs(rows, ks, drafts, times)
        verdicts = []
        for b, (row, draft) in enumerate(zip(rows, drafts)):
            k = len(draft.tokens)
            try:
                verdict = self._accept(row, draft, logits[b, logits.shape[1] - k - 1:])
            except Exception as err:  # from this row's own logits and settings alone: its fault
                err._specdecode_row = row.request_id
                raise
            self._emit(row, verdict, outputs[row.request_id])
            self._record(row, draft, ks[b], verdict.n, outputs[row.request_id], times)
            verdicts.append(verdict)
        self._commit(rows, verdicts)
        self._leave([row for row in rows if row.out.finish_reason is not None], outputs)
        if self.threads is not None and not self.has_work:
            self.threads.release()  # idle: the application's torch gets its thread count back
        return list(outputs.values())

    def _plan(self, rows: list[_Row]) -> list[int]:
        """Phase 1: γ per row from its schedule and guard, clipped to its room; capped where fewer
        drafts serve the batch better (engine.cost)."""
        limit = self.target.max_length
        ks = [row.policy.plan(row.config.max_new_tokens - len(row.out.token_ids), limit, len(row.tokens))
              for row in rows]
        if self.first_step_plain:
            # a row's first token comes from the target's prompt read alone: no drafts fed with it
            # (free prompt-lookup ones cost their tokens in that read too) and no draft model
            # reading the prompt first, which it does on the row's second step. γ is chosen from
            # the past only, so this is exact (§2.3).
            ks = [k if row.stats.num_target_calls else 0 for row, k in zip(rows, ks)]
        return self._batch_plan(rows, ks) if self.cost is not None else ks

    def _propose(self, rows: list[_Row], ks: list[int]) -> tuple[list[Draft], StepTimes]:
        """Phase 2: up to ks[b] drafts per row with their q, cut where a grammar forbids them."""
        synchronize(self.device)
        start = self.clock()
        if self.proposer is not None:
            read_before = proposer_reads(self.proposer)
            drafts = self.proposer.propose(rows, ks)
            read_after = proposer_reads(self.proposer)
            reads = (read_after[0] - read_before[0], read_after[1] - read_before[1])
        else:
            drafts, reads = [no_draft(self.target.vocab_size, self.device)] * len(rows), (0.0, 0)
        if any(row.pipeline is not None and row.pipeline.grammar is not None for row in rows):
            drafts = [_cut_to_grammar(row, draft) for row, draft in zip(rows, drafts)]
        drafts = [row.policy.price(draft) for row, draft in zip(rows, drafts)]
        synchronize(self.device)
        return drafts, StepTimes(draft_s=self.clock() - start, read_s=reads[0], read_tokens=reads[1])

    def _score(self, rows: list[_Row], drafts: list[Draft], times: StepTimes) -> torch.Tensor:
        """Phase 3: ONE target call over every row's pending token(s) and drafts → logits
        [B, width, V], row b's last k_b + 1 positions scoring its drafts and the token after. A
        draft id the target cannot embed is fed as 0: the verifier rejects it, and what follows
        is discarded."""
        start = self.clock()
        embeddable = self.target.num_embeddings
        feeds = [row.pending + [t if t < embeddable else 0 for t in d.tokens.tolist()] for row, d in zip(rows, drafts)]
        width = max(len(d.tokens) for d in drafts) + 1
        trees = [d.parents for d in drafts]
        if any(t is not None for t in trees):  # token trees: one call with a tree mask (verify.tree_step)
            logits = self.target.forward(feeds, width, trees)
        else:
            logits = self.target.forward(feeds, width)
        synchronize(self.device)
        times.target_s = self.clock() - start
        times.fed = max(len(f) for f in feeds)  # every row is padded to the widest feed
        return logits

    def _observe_costs(self, rows: list[_Row], ks: list[int], drafts: list[Draft], times: StepTimes) -> None:
        """The batch cost model learns from this step's timings; guards get its current c and slope."""
        self.cost.observe_target(len(rows) * times.fed, times.fed, times.target_s)
        if times.read_s == 0:  # a read is a row's one-off cost, not a draft step's
            self.cost.observe_draft(max(d.forwards for d in drafts), sum(k > 0 for k in ks), times.draft_s)
        else:
            self.cost.observe_read(times.read_tokens, times.read_s)
        self._refresh_guards(rows)

    def _accept(self, row: _Row, draft: Draft, logits: torch.Tensor) -> Verdict:
        """Phase 4: the row's drafts verified with its own generator (paper §2.3; a tree by
        verify.tree_step). logits: [k + 1, V], the target's at the row's drafted positions."""
        ids = draft.tokens.tolist()
        k = len(ids)
        if draft.parents is not None:
            n, new, origins, path, kept = verify_tree_row(draft, ids, logits, row.config, row.generator, row.stats)
            positions = [0] + [node + 1 for node in path]  # logits row of each emitted token
        else:
            n, token = self.accept_rule(draft.tokens, draft.probs if k else None, logits, row.config,
                                        row.generator, row.tokens, row.pipeline)
            new = ids[:n] + [token]
            origins = [ACCEPTED] * n + [TARGET if k == 0 else BONUS if n == k else CORRECTED]
            path, kept, positions = None, n, list(range(n + 1))
        logprobs = [None] * len(new) if row.config.logprobs is None else \
            token_logprobs(logits[positions], new, row.config.logprobs)
        return Verdict(n, new, origins, logprobs, path, kept)

    @staticmethod
    def _emit(row: _Row, verdict: Verdict, output: StepOutput) -> None:
        """Phase 5, per row: the new tokens, one by one through the row's stops (the output may
        end inside them); the row's committed sequence grows by all of them (the caches too)."""
        for token_id, origin, logprob in zip(verdict.new, verdict.origins, verdict.logprobs):
            output.events.append(row.out.push(token_id, origin, logprob))
            if row.out.finish_reason is not None:
                break
        row.tokens += verdict.new
        row.pending = verdict.new[-1:]

    def _commit(self, rows: list[_Row], verdicts: list[Verdict]) -> None:
        """Phase 5, caches: the target's and the proposer's rolled back to exactly each row's
        committed prefix (rule 5; a tree keeps its accepted path)."""
        if any(v.path is not None for v in verdicts):
            self.target.keep_tree_paths([v.path for v in verdicts])
        self.target.truncate([len(row.tokens) - 1 for row in rows])
        if self.proposer is not None:
            self.proposer.commit([v.kept_in_chain for v in verdicts], [v.new for v in verdicts])

    def _batch_plan(self, rows: list[_Row], ks: list[int]) -> list[int]:
        """ks, with every guarded row's γ capped where fewer drafts serve the batch better (engine.cost)."""
        guarded = [row.policy.guard is not None for row in rows]
        if sum(guarded) < 2 or not any(ks) or any(k for k, g in zip(ks, guarded) if not g):
            return ks  # one row's own guard decides; an unguarded drafting row widens the step anyway
        alphas = [row.stats.alpha_estimate if row.stats.num_accepted + row.stats.num_rejected else None
                  for row in rows]
        unread = getattr(self.proposer, "unread", lambda: None)()
        left = [row.config.max_new_tokens - len(row.out.token_ids) for row in rows]
        cap = self.cost.gamma_cap(ks, alphas, unread, left)
        if cap == max(ks) and not self.cost.probing:
            return ks
        capped = [min(k, cap) for k in ks]
        if self.cost.probing:  # one row drafts: the one that has drafted least (its α is least known)
            probe = min((b for b, k in enumerate(ks) if k), key=lambda b: rows[b].stats.num_drafted)
            capped = [k if b == probe else 0 for b, k in enumerate(capped)]
        for row, k, c in zip(rows, ks, capped):
            row.stats.num_batch_caps += int(c < k)
        return capped

    def _refresh_guards(self, rows: list[_Row]) -> None:
        """Keep each guard's c and slope at what the loop measures now (engine.guard)."""
        costs = {}  # per γ_max: the same for every row of this batch size
        for row in rows:
            guard, k = row.policy.guard, row.policy.k_max
            if guard is None:
                continue
            if k not in costs:
                costs[k] = self.cost.guard_costs(len(rows), k)
            if costs[k] is not None:
                guard.set_costs(*costs[k])

    @staticmethod
    def _record(row: _Row, draft: Draft, planned: int, n: int, output: StepOutput, times: StepTimes) -> None:
        """Phase 6: the row's statistics and its γ policy learn from the step."""
        k = len(draft.chain)  # a tree's γ is its chain; its side leaves are extra candidates
        stats = row.stats
        drafted, kept = stats.num_drafted, stats.num_accepted
        stats.num_target_calls += 1
        stats.time_target_s += times.target_s
        if k:
            stats.time_draft_s += times.draft_s
        stats.num_draft_calls += draft.forwards
        stats.num_lookup_steps += int(draft.lookup)
        stats.record_step(k, n, len(output.events))
        stats.num_generated = len(row.out.token_ids)
        row.policy.record(planned, k, n, draft)
        output.num_drafted, output.num_accepted = stats.num_drafted - drafted, stats.num_accepted - kept
        output.stats = stats.snapshot()

    def _admit(self) -> list[_Row]:
        """Waiting requests join the batch while there is room; the prompts of those that ask
        for prompt logprobs are scored first. Returns the rows whose prompts were scored: those
        that asked for no new tokens finished (never in the batch), the others running."""
        joining, scored = [], []
        while self.waiting and (self.capacity is None or len(self.running) + len(joining) < self.capacity):
            request_id, request = self.waiting.popleft()
            if request.config.prompt_logprobs is None:
                joining.append((request_id, request))
                continue
            row = self._score_prompt(request_id, request)
            if request.config.max_new_tokens == 0:
                row.out.finish("length")
                scored.append(row)
            else:
                joining.append((request_id, request, row))
        # A row alone reads its prompt with its first step's forward (prefill and verify in one
        # call); a row joining others reads all but its prompt's last token now, on its own,
        # so that no other row's feed is padded to its prompt's length.
        alone = not self.running and len(joining) == 1
        for request_id, request, *scored_row in joining:
            encoder_input, prompt = request.encoder_input_ids, list(request.prompt_ids)
            if alone:  # (single-row backends, e.g. encoder–decoder ones, only ever get this)
                self.target.add_row(encoder_input)
            else:
                self.target.add_row(encoder_input, prefix_ids=prompt[:-1])
            if self.proposer is not None:
                self.proposer.add_row(prompt, encoder_input)
            row = _Row(request_id, request, self.tokenizer, self.proposer is not None, self.device,
                       self.target.vocab_size, self.clock)
            # whether its logits are the same bits whatever else the target computes (models/invariant.py)
            row.stats.batch_invariant = bool(getattr(self.target, "batch_invariant", False))
            sampling = request.config.sampling
            row.stats.repeatable = row.stats.batch_invariant and (sampling.greedy or (
                request.config.verification == "drafter-invariant" and sampling.seed is not None))
            if scored_row:
                row.prompt_logprobs = scored_row[0].prompt_logprobs
                scored.append(row)
            if not alone:
                row.pending = prompt[-1:]
            self.running.append(row)
        return scored

    def _score_prompt(self, request_id: int, request: Request) -> _Row:
        """A row (outside the batch) holding the prompt's logprobs: one plain target forward."""
        score = getattr(self.target, "score", None)
        if score is None or request.encoder_input_ids is not None:
            raise ValueError("prompt logprobs need a decoder-only target")
        prompt = list(request.prompt_ids)
        row = _Row(request_id, request, self.tokenizer, False, self.device, clock=self.clock)
        row.prompt_logprobs = [None]
        done = 0  # positions scored: position j's logits give token j + 1's logprob
        for logits in score(prompt):  # in chunks: a long prompt never holds all its logits at once
            following = prompt[done + 1:done + 1 + len(logits)]
            row.prompt_logprobs += token_logprobs(logits[:len(following)], following, request.config.prompt_logprobs)
            done += len(logits)
        return row

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
