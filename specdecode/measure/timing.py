"""Timing a backend's forward calls: the cost coefficient c (paper Def. 3.7) and the verify cost
r(k) = T(k-token call) / T(1-token call), which Thm 3.8 takes to be 1 (§3.3)."""

from __future__ import annotations

import statistics
import time

import torch


def time_forwards(backend, context: list[int], sizes: list[int], repeats: int = 7,
                  encoder_input_ids: list[int] | None = None) -> dict[int, float]:
    """Median seconds of one call appending k tokens (and scoring all k) after `context`, for each
    k in sizes, on one row. The row is rolled back after each call, so every call sees the same
    length; the sizes are interleaved and a first round is discarded, so warm-up and drift hit
    all alike. The backend is left empty."""
    backend.reset()
    backend.add_row(encoder_input_ids)
    backend.forward([context], 1)
    times = {k: [] for k in sizes}
    for round_ in range(repeats + 1):
        for k in sizes:
            start = time.perf_counter()
            backend.forward([(context * k)[-k:]], k)
            if backend.device.type == "cuda":
                torch.cuda.synchronize(backend.device)
            if round_:
                times[k].append(time.perf_counter() - start)
            backend.truncate([len(context)])
    backend.reset()
    return {k: statistics.median(v) for k, v in times.items()}


def measure_costs(target, draft, context: list[int], sizes: list[int] = (1,), repeats: int = 7,
                  encoder_input_ids: list[int] | None = None) -> dict:
    """{"target_step_s", "r": {k: r(k) for k in sizes}, and with a draft "draft_step_s", "c"} at
    this context length (an encoder–decoder pair's decoders attend to encoder_input_ids)."""
    target_times = time_forwards(target, context, sorted({1, *sizes}), repeats, encoder_input_ids)
    one = target_times[1]
    costs = {"target_step_s": one, "r": {k: t / one for k, t in target_times.items()}}
    if draft is not None:
        costs["draft_step_s"] = time_forwards(draft, context, [1], repeats, encoder_input_ids)[1]
        costs["c"] = costs["draft_step_s"] / one
    return costs
