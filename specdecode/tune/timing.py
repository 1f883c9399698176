"""Timing a backend's forward calls: the cost coefficient c (paper Def. 3.7) and the verify cost
r(k) = T(k-token call) / T(1-token call), which Thm 3.8 takes to be 1 (§3.3)."""

from __future__ import annotations

import statistics
import time

import torch


def _timer(backend, context: list[int], encoder_input_ids):
    """A function k → seconds of one call appending k tokens (and scoring all k) after `context`
    on one row, rolled back after each call so that every call sees the same length."""
    backend.reset()
    backend.add_row(encoder_input_ids)
    backend.forward([context], 1)

    def once(k: int) -> float:
        start = time.perf_counter()
        backend.forward([(context * k)[-k:]], k)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        seconds = time.perf_counter() - start
        backend.truncate([len(context)])
        return seconds
    return once


def time_interleaved(backends: dict, context: list[int], sizes: dict, repeats: int = 3,
                     encoder_input_ids: list[int] | None = None) -> dict:
    """{name: {k: median seconds of one call appending k tokens}} for several backends, timed
    round by round in turn (each round every backend, every size of its own), so that a slow
    spell of the machine hits every candidate alike rather than the one being timed then.

    Args:
        backends: {name: backend} (each left empty).  sizes: {name: the k to time for it}.
        encoder_input_ids: what an encoder–decoder pair's decoders attend to (None: decoder-only).
    """
    timers = {name: _timer(backend, context, encoder_input_ids) for name, backend in backends.items()}
    times = {name: {k: [] for k in sizes[name]} for name in backends}
    for round_ in range(repeats + 1):
        for name, once in timers.items():
            for k in sizes[name]:
                seconds = once(k)
                if round_:  # the first round warms up
                    times[name][k].append(seconds)
    for backend in backends.values():
        backend.reset()
    return {name: {k: statistics.median(v) for k, v in by_k.items()} for name, by_k in times.items()}


def measure_costs(target, draft, context: list[int], sizes: list[int] = (1,), repeats: int = 7,
                  encoder_input_ids: list[int] | None = None) -> dict:
    """{"target_step_s", "r": {k: r(k) for k in sizes}, and with a draft "draft_step_s", "c"} at
    this context length (an encoder–decoder pair's decoders attend to encoder_input_ids).

    Each round times every target size and a draft step back to back, and c and r(k) are medians
    of the rounds' own ratios: a load spike slows both models of a round alike, where timing
    one model after the other would charge it to one of them (and a guard given that c would
    pause drafting for a whole run). The backends are left empty."""
    sizes = sorted({1, *sizes})
    target_once = _timer(target, context, encoder_input_ids)
    draft_once = _timer(draft, context, encoder_input_ids) if draft is not None else None
    times = {k: [] for k in sizes}
    drafts = []
    for round_ in range(repeats + 1):
        row = {k: target_once(k) for k in sizes}
        step = draft_once(1) if draft_once else None
        if round_:
            for k in sizes:
                times[k].append(row[k])
            drafts.append(step)
    target.reset()
    one = statistics.median(times[1])
    costs = {"target_step_s": one,
             "r": {k: statistics.median(t / o for t, o in zip(times[k], times[1])) for k in sizes}}
    if draft is not None:
        draft.reset()
        costs["draft_step_s"] = statistics.median(drafts)
        costs["c"] = statistics.median(d / o for d, o in zip(drafts, times[1]))
    return costs


def guard_costs(target, draft, gamma: int, encoder_decoder: bool = False) -> tuple[float, float, float]:
    """(c, slope, base) for the guard (engine.guard, Cor. 3.9): c = a draft step's time over a
    target step's (0 without a draft model: free drafts cost no forward), and a call verifying
    k >= 1 drafts priced 1 + base + slope·k target steps, the line through r(2) and r(γ+1) (base
    >= 0: where r is concave the line from r(1) to r(γ+1) instead, and where r(γ+1) < r(2) the
    wide call's cost r(γ+1) for any verify); timed at a 64-token context
    (an encoder–decoder pair's decoders attend to an encoded input of it)."""
    vocab = target.vocab_size if draft is None else min(target.vocab_size, draft.vocab_size)
    context = [i % vocab for i in range(100, 164)]
    costs = measure_costs(target, draft, context, [2, gamma + 1], repeats=3,
                          encoder_input_ids=context if encoder_decoder else None)
    return (costs.get("c", 0.0), *verify_line(costs["r"][2], costs["r"][gamma + 1], gamma))


def verify_line(r2: float, r_last: float, gamma: int) -> tuple[float, float]:
    """(slope, base) of the verify cost 1 + base + slope·k through r(2) and r(γ+1), both >= 0."""
    if gamma == 1 or r_last < r2:  # no rising line through both (AMX: r(2) 1.24, r(9) 1.06): the
        return 0.0, max(r_last - 1, 0.0)  # wide call's cost for any verify
    slope = (r_last - r2) / (gamma - 1)
    if r2 - 1 - slope < 0:  # concave: the line from r(1) instead
        return max(r_last - 1, 0.0) / gamma, 0.0
    return slope, r2 - 1 - slope
