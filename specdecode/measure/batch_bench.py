"""Throughput of batched decoding, plain and speculative, at several batch sizes.

The paper's speedup assumes spare compute (§3.3): the target's k+1-token verify costs about one
token's forward. Batching spends that spare compute on other requests, so speculation's gain
shrinks as the batch grows; this measures where it ends on a given machine.
"""

from __future__ import annotations

import dataclasses
import time

from specdecode.engine.driver import run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams


def batch_throughput(target_backend, draft_backend, prompt_ids: list[list[int]], batch_sizes: list[int],
                     new_tokens: int, gamma: int, sampling: SamplingParams,
                     draft_confidence: float = 0.0, make_proposer=None, guard_costs: tuple[float, ...] | None = None,
                     batch_guard: bool = False) -> list[dict]:
    """Time plain and speculative batched decoding at each batch size (paper §3.3's assumption).

    Every row generates exactly `new_tokens` (EOS is ignored), so batch sizes compare like for
    like. Batch size b takes prompts prompt_ids[0], [1], ... cycling; with a seed, row i uses
    seed + i. Only one run per setting: warm the models up before calling for stable numbers.

    Args:
        target_backend, draft_backend: backends (specdecode.models); draft_backend None
            measures plain decoding only.
        prompt_ids: non-empty lists of token ids.  batch_sizes: integers >= 1.
        new_tokens: tokens per row (>= 1).  gamma: γ, drafts per step (>= 1).
        sampling: the sampling settings of every row.  draft_confidence: dynamic γ, in [0, 1).
        make_proposer: builds the speculative runs' proposer (default: the draft model alone with
            draft_confidence), e.g. a decoder's configured one (prompt lookup, trees).
        guard_costs, batch_guard: the guard of each row (DecodeConfig.costs) and the engine's batch
            cost model (engine.cost) in the speculative runs, as a SpeculativeDecoder sets them.
    Returns:
        one dict per (batch size, method), plain first: batch_size, method ("plain" |
        "speculative"), gamma (0 for plain), num_tokens (all rows), wall_time_s,
        tokens_per_second (all rows), mean_latency_s (mean over rows of start → row finished),
        mean_tokens_per_call (per row, averaged), acceptance_rate (pooled; None for plain),
        speedup (plain wall time / this wall time at the same batch size).
    Raises:
        ValueError: empty or empty-prompt prompt_ids, a batch size < 1, new_tokens < 1, gamma < 1.
    """
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids must be a non-empty list of non-empty token-id lists")
    if any(not isinstance(b, int) or b < 1 for b in batch_sizes) or not batch_sizes:
        raise ValueError(f"batch_sizes must be integers >= 1, got {batch_sizes!r}")
    if new_tokens < 1 or gamma < 1:
        raise ValueError(f"new_tokens and gamma must be >= 1, got {new_tokens} and {gamma}")
    methods = ["plain"] + (["speculative"] if draft_backend is not None else [])
    rows = []
    for batch_size in batch_sizes:
        prompts = [list(prompt_ids[i % len(prompt_ids)]) for i in range(batch_size)]
        configs = [DecodeConfig(max_new_tokens=new_tokens, num_speculative_tokens=gamma, costs=guard_costs,
                                sampling=dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i))
                   for i in range(batch_size)]
        plain_wall = None
        for method in methods:
            proposer = None
            if method == "speculative":
                proposer = make_proposer() if make_proposer else DraftModelProposer(draft_backend, draft_confidence)
            start = time.perf_counter()
            results = run_all(target_backend, proposer, [Request(p, c) for p, c in zip(prompts, configs)],
                              batch_guard=batch_guard)
            wall = time.perf_counter() - start
            plain_wall = wall if plain_wall is None else plain_wall
            drafted = sum(r.stats.num_drafted for r in results)
            num_tokens = sum(len(r.token_ids) for r in results)
            rows.append({
                "batch_size": batch_size, "method": method, "gamma": gamma if proposer is not None else 0,
                "num_tokens": num_tokens, "wall_time_s": wall, "tokens_per_second": num_tokens / wall,
                "mean_latency_s": sum(r.stats.wall_time_s for r in results) / batch_size,
                "mean_tokens_per_call": sum(r.stats.mean_tokens_per_call for r in results) / batch_size,
                "acceptance_rate": sum(r.stats.num_accepted for r in results) / drafted if drafted else None,
                "speedup": plain_wall / wall,
            })
    return rows
