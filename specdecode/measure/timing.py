"""Timing a backend's forward calls: the cost coefficient c (paper Def. 3.7) and the verify cost
r(k) = T(k-token call) / T(1-token call), which Thm 3.8 takes to be 1 (§3.3)."""

from __future__ import annotations

import statistics
import time

import torch


def time_forwards(backend, context: list[int], sizes: list[int], repeats: int = 7) -> dict[int, float]:
    """Median seconds of one call appending k tokens (and scoring all k) after `context`, for each
    k in sizes. The cache is rolled back after each call, so every call sees the same length; the
    sizes are interleaved and a first round is discarded, so warm-up and drift hit all alike."""
    backend.reset()
    backend.forward(torch.tensor(context, dtype=torch.long), 1)
    times = {k: [] for k in sizes}
    for round_ in range(repeats + 1):
        for k in sizes:
            tokens = torch.tensor((context * k)[-k:], dtype=torch.long)
            start = time.perf_counter()
            backend.forward(tokens, k)
            if round_:
                times[k].append(time.perf_counter() - start)
            backend.truncate(len(context))
    backend.reset()
    return {k: statistics.median(v) for k, v in times.items()}


def measure_costs(target, draft, context: list[int], sizes: list[int] = (1,), repeats: int = 7) -> dict:
    """{"target_step_s", "r": {k: r(k) for k in sizes}, and with a draft "draft_step_s", "c"} at
    this context length."""
    target_times = time_forwards(target, context, sorted({1, *sizes}), repeats)
    one = target_times[1]
    costs = {"target_step_s": one, "r": {k: t / one for k, t in target_times.items()}}
    if draft is not None:
        costs["draft_step_s"] = time_forwards(draft, context, [1], repeats)[1]
        costs["c"] = costs["draft_step_s"] / one
    return costs
