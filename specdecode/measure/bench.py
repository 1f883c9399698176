"""Side-by-side speed in one process, with the theory beside it: behind `specdecode bench`.

Configurations, all on the same prompts, interleaved (every configuration runs prompt i before
any runs prompt i+1, so slow spells of the machine hit all alike):
    transformers `generate` with the target alone (the baseline: ratio 1.00)
    specdecode plain decoding (the same loop with no draft)
    specdecode with the draft model at each fixed γ (no early stop, no lookup): the γ sweep
    specdecode as configured (the decoder's defaults: dynamic γ, prompt lookup, int8 draft, ...)
    prompt lookup alone (c ≈ 0, paper §3.6)
    transformers assisted generation (`assistant_model=`) on the same pair
Every run emits exactly `new_tokens` tokens (EOS does not stop it) so tokens/s compare.

It also measures on this machine: c = draft step / target step (Def. 3.7) and the verify cost
r(k) = T(k-token target call) / T(1-token call), which Thm 3.8 takes to be 1 (§3.3). For each γ
it puts the measured speedup next to Thm 3.8's prediction from the measured α and c, and next to
the prediction corrected by r: E(α, γ) / (γc + r(γ+1)) (paper Table 4's comparison).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Callable, get_args

import torch

from specdecode.analysis import expected_tokens, optimal_gamma, walltime_improvement
from specdecode.config import Verification
from specdecode.measure.batch_bench import batch_throughput
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode import proposers
from specdecode.proposers import DraftModelProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams
from specdecode.tune.timing import measure_costs

BASELINE = "transformers generate, target alone"
LENIENCE_GAMMA = 4


class NoEOS:
    """A backend whose logits never allow the EOS ids: what transformers' `min_new_tokens` does to
    the target and to the assistant, so every side writes the same kind of text for exactly
    `new_tokens` tokens (instead of ours running on past an EOS that transformers forbids).
    Everything but forward is the wrapped backend's."""

    def __init__(self, backend, eos_token_ids):
        self.backend = backend
        self.eos = [i for i in eos_token_ids if i < backend.vocab_size]

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, feeds: list[list[int]], num_logits: int, trees=None) -> torch.Tensor:
        logits = (self.backend.forward(feeds, num_logits) if trees is None
                  else self.backend.forward(feeds, num_logits, trees)).clone()  # inference tensors are read-only
        logits[..., self.eos] = float("-inf")
        return logits


def _hf_runner(model, new_tokens: int, sampling: SamplingParams, pad_id: int, eos_token_ids, assistant=None,
               schedule: str = "heuristic", assistant_tokens: int = 4):
    def go(ids: list[int], seed: int):
        kwargs = dict(do_sample=False)
        if not sampling.greedy:
            torch.manual_seed(seed)
            kwargs = dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                          top_p=sampling.top_p, min_p=sampling.min_p or None)
        saved = None
        if assistant is not None:
            config = assistant.generation_config
            saved = config.num_assistant_tokens_schedule, config.num_assistant_tokens
            config.num_assistant_tokens_schedule, config.num_assistant_tokens = schedule, assistant_tokens
            kwargs["assistant_model"] = assistant
        try:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     eos_token_id=list(eos_token_ids), pad_token_id=pad_id,
                                     repetition_penalty=1.0, **kwargs)
        finally:
            if saved is not None:  # the draft model may be the user's object
                assistant.generation_config.num_assistant_tokens_schedule, \
                    assistant.generation_config.num_assistant_tokens = saved
        return out[0, len(ids):].tolist(), None
    return go


def _our_runner(target, make_proposer: Callable, gamma: int, new_tokens: int, sampling: SamplingParams,
                guard_costs: tuple[float, ...] | None = None, lenience: float = 1.0, gamma_schedule: str = "fixed",
                verification: str = "token"):
    def go(ids: list[int], seed: int):
        params = dataclasses.replace(sampling, seed=seed)
        result = run(target, make_proposer(), ids, DecodeConfig(max_new_tokens=new_tokens, sampling=params,
                                                                 num_speculative_tokens=gamma,
                                                                 costs=guard_costs, lenience=lenience,
                                                                 gamma_schedule=gamma_schedule,
                                                                 verification=verification))
        return result.token_ids, result.stats
    return go


def build_configs(decoder, new_tokens: int, sampling: SamplingParams, gammas: list[int],
                  hf_schedules: list[str], hf_drafts: dict | None = None, lenience: list[float] = (),
                  headline: bool = False, compare_verification: bool = False,
                  tree_widths: list[int] = ()) -> dict[str, Callable]:
    """name → go(ids, seed) -> (token ids, GenerationStats or None).

    hf_schedules: "heuristic" or "constant:N", each optionally "@LABEL" naming the draft in
        hf_drafts (a dict label → transformers draft model) given to assisted generation; without
        a label, the first of hf_drafts (default: {"ours": the decoder's own draft model object}).
    lenience: values l < 1 add LOSSY runs (paper A.5) at γ = LENIENCE_GAMMA.
    headline: skip our plain decoding and prompt lookup alone (they cost a target-alone run each).
    compare_verification: also run the configured decoder with each other verification rule, and
        each γ of the sweep with block verification (the sweep itself is token-wise: Thm 3.8's
        theory beside it assumes that rule).
    tree_widths: also run the configured decoder drafting token trees of each of these widths.
    """
    eos = decoder.eos_token_ids
    model = decoder.target.backend.model
    target = NoEOS(decoder.target.backend, eos)
    pad = decoder.tokenizer.pad_token_id if decoder.tokenizer.pad_token_id is not None else decoder.tokenizer.eos_token_id
    configs = {BASELINE: _hf_runner(model, new_tokens, sampling, pad, eos)}
    if not headline:
        configs["specdecode plain"] = _our_runner(target, lambda: None, 0, new_tokens, sampling)
    draft = NoEOS(decoder.draft.backend, eos) if decoder.draft is not None else None
    if draft is not None:
        for g in gammas:
            configs[f"specdecode γ={g}"] = _our_runner(target, lambda: DraftModelProposer(draft), g, new_tokens, sampling)
        for value in lenience:
            configs[f"specdecode γ={LENIENCE_GAMMA}, lenience {value:g} (lossy)"] = _our_runner(
                target, lambda: DraftModelProposer(draft), LENIENCE_GAMMA, new_tokens, sampling, lenience=value)
    # As generate() does: the guard runs for greedy (and unseeded) requests; bench seeds every run.
    configs["specdecode as configured"] = _our_runner(target, lambda: proposers.for_pair(decoder.pair, decoder.decoder_config, decoder.plan.free_drafts, draft),
                                                      decoder.num_speculative_tokens, new_tokens, sampling,
                                                      decoder.guard_costs if sampling.greedy else None,
                                                      gamma_schedule=decoder.decoder_config.gamma_schedule,
                                                      verification=decoder.decoder_config.verification)
    if compare_verification and draft is not None:
        for other in (rule for rule in get_args(Verification) if rule != decoder.decoder_config.verification):
            configs[f"specdecode as configured, {other} verification"] = _our_runner(
                target, lambda: proposers.for_pair(decoder.pair, decoder.decoder_config, decoder.plan.free_drafts, draft), decoder.num_speculative_tokens, new_tokens, sampling,
                decoder.guard_costs if sampling.greedy else None, gamma_schedule=decoder.decoder_config.gamma_schedule,
                verification=other)
        for g in gammas:
            configs[f"specdecode γ={g}, block verification"] = _our_runner(
                target, lambda: DraftModelProposer(draft), g, new_tokens, sampling, verification="block")
    for width in tree_widths if draft is not None else ():
        configs[f"specdecode as configured, tree width {width}"] = _our_runner(
            target, lambda width=width: proposers.for_pair(decoder.pair, decoder.decoder_config, decoder.plan.free_drafts, draft, width), decoder.num_speculative_tokens,
            new_tokens, sampling, decoder.guard_costs if sampling.greedy else None,
            gamma_schedule=decoder.decoder_config.gamma_schedule)
    if not headline:
        configs["prompt lookup alone"] = _our_runner(
            target, lambda: PromptLookupProposer(target.vocab_size), decoder.num_speculative_tokens, new_tokens, sampling)
    # transformers' assisted generation needs a transformers draft (not one on llama.cpp)
    own = getattr(decoder.draft.backend, "model", None) if draft is not None else None
    hf_drafts = hf_drafts or ({"ours": own} if own is not None else {})
    for spec in hf_schedules if hf_drafts else ():
        schedule, _, label = spec.partition("@")
        label = label or next(iter(hf_drafts))
        kind, _, tokens = schedule.partition(":")
        configs[f"transformers assisted, {schedule}, {label} draft"] = _hf_runner(
            model, new_tokens, sampling, pad, eos, hf_drafts[label], kind, int(tokens or 4))
    return configs


def run_configs(configs: dict[str, Callable], prompts: list[tuple[str, list[int]]], repeats: int,
                progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Time every configuration on every (task, ids) prompt, interleaved; one warm-up run each.

    Returns {"seconds": {config: {task: [per repeat]}}, "tokens": {config: {task: [...]}},
    "stats": {config: [GenerationStats of repeat 0]}, "outputs": {config: [token ids of repeat 0]}}.
    """
    for go in configs.values():  # warm-up: first calls pay one-time costs (allocations, caches)
        go(prompts[0][1][:16], 0)
    seconds = {name: {} for name in configs}
    tokens = {name: {} for name in configs}
    stats = {name: [] for name in configs}
    outputs = {name: [] for name in configs}
    total, done = repeats * len(prompts) * len(configs), 0
    for rep in range(repeats):
        for i, (task, ids) in enumerate(prompts):
            for name, go in configs.items():
                start = time.perf_counter()
                out, st = go(ids, 1000 * rep + i)
                elapsed = time.perf_counter() - start
                for table, value in ((seconds, elapsed), (tokens, len(out))):
                    per_task = table[name].setdefault(task, [0.0] * repeats)
                    per_task[rep] += value
                if rep == 0:
                    outputs[name].append(out)
                    if st is not None:
                        stats[name].append(st)
                done += 1
                if progress:
                    progress(done, total, f"repeat {rep + 1}, prompt {i + 1} ({task}), {name}")
    return {"seconds": seconds, "tokens": tokens, "stats": stats, "outputs": outputs}


def _median_rate(tokens: list[float], seconds: list[float]) -> float:
    return statistics.median(t / s for t, s in zip(tokens, seconds))


def summarize(timings: dict, costs: dict, tasks: list[str]) -> list[dict]:
    """One row per configuration: tokens/s and speedup over the baseline (medians over repeats of
    the per-repeat ratio), overall and per task; α̂ and tokens per call; Thm 3.8 predictions."""
    rows = []
    base_outputs = timings["outputs"][BASELINE]
    plain_outputs = timings["outputs"].get("specdecode plain")
    all_tasks = ["all"] + tasks

    def totals(name):
        secs = [sum(timings["seconds"][name][t][r] for t in tasks) for r in range(len(timings["seconds"][name][tasks[0]]))]
        toks = [sum(timings["tokens"][name][t][r] for t in tasks) for r in range(len(secs))]
        return toks, secs

    for name in timings["seconds"]:
        row = {"config": name, "tokens_per_s": {}, "speedup": {}}
        for task in all_tasks:
            toks, secs = totals(name) if task == "all" else (timings["tokens"][name][task], timings["seconds"][name][task])
            btoks, bsecs = totals(BASELINE) if task == "all" else (timings["tokens"][BASELINE][task],
                                                                   timings["seconds"][BASELINE][task])
            row["tokens_per_s"][task] = _median_rate(toks, secs)
            row["speedup"][task] = statistics.median((t / s) / (bt / bs) for t, s, bt, bs in zip(toks, secs, btoks, bsecs))
        if plain_outputs is not None:  # Thm 3.8 compares with our own target-alone decoding
            (toks, secs), (ptoks, psecs) = totals(name), totals("specdecode plain")
            row["speedup_vs_plain"] = statistics.median((t / s) / (pt / ps) for t, s, pt, ps in zip(toks, secs, ptoks, psecs))
        outs = timings["outputs"][name]
        if plain_outputs is not None:
            row["same_tokens_as_plain"] = sum(a == b for a, b in zip(outs, plain_outputs))
        row["same_tokens_as_hf"] = sum(a == b for a, b in zip(outs, base_outputs))
        st = timings["stats"][name]
        verified = sum(s.num_accepted + s.num_rejected for s in st)
        if verified:
            row["num_accepted"], row["num_verified"] = sum(s.num_accepted for s in st), verified
            row["alpha_hat"] = row["num_accepted"] / verified
            row["accepted_over_drafted"] = sum(s.num_accepted for s in st) / sum(s.num_drafted for s in st)
            row["tokens_per_call"] = sum(s.num_generated for s in st) / sum(s.num_target_calls for s in st)
            row["draft_share_of_time"] = sum(s.time_draft_s for s in st) / sum(s.wall_time_s for s in st)
            # The ceiling of this configuration: Eq. 1 at its α̂ and γ_max with a free
            # draft (c → 0), over the measured cost of verifying γ_max drafts, r(γ_max + 1).
            gamma_max = len(st[0].accepted_per_position)
            r_full = costs.get("r", {}).get(gamma_max + 1)
            if gamma_max and r_full:
                row["limit_c0"] = expected_tokens(min(row["alpha_hat"], 0.999999), gamma_max) / r_full
        if st:  # where the time goes inside the loop (the first target call also reads the prompt)
            wall = sum(s.wall_time_s for s in st)
            row["target_call_ms"] = 1000 * sum(s.time_target_s for s in st) / sum(s.num_target_calls for s in st)
            drafts = sum(s.num_draft_calls for s in st)
            row["draft_forward_ms"] = 1000 * sum(s.time_draft_s for s in st) / drafts if drafts else None
            row["other_share_of_time"] = 1 - sum(s.time_target_s + s.time_draft_s for s in st) / wall
        sweep = re.fullmatch(r"specdecode γ=(\d+)", name)
        if sweep and "alpha_hat" in row and "c" in costs:
            gamma = int(sweep.group(1))
            alpha, c, r = min(row["alpha_hat"], 0.999999), costs["c"], costs["r"].get(gamma + 1)
            row["gamma"] = gamma
            row["eq1_tokens_per_call"] = expected_tokens(alpha, gamma)
            row["predicted"] = walltime_improvement(alpha, gamma, c)
            row["predicted_corrected"] = expected_tokens(alpha, gamma) / (gamma * c + r) if r else None
        rows.append(row)
    return rows


def theory(rows: list[dict], costs: dict, max_gamma: int) -> dict:
    """The best γ by Thm 3.8 from the pooled α̂ of the γ sweep and the measured c, and with r(k)."""
    sweep = [r for r in rows if "gamma" in r]
    if not sweep or "c" not in costs:
        return {}
    alpha = sum(r["num_accepted"] for r in sweep) / sum(r["num_verified"] for r in sweep)
    c, r = costs["c"], costs["r"]
    corrected = {g: expected_tokens(min(alpha, 0.999999), g) / (g * c + r[g + 1]) for g in range(1, max_gamma) if g + 1 in r}
    best_measured = max(sweep, key=_measured)
    return {"alpha_pooled": alpha, "c": c, "optimal_gamma": optimal_gamma(min(alpha, 0.999999), c),
            "optimal_speedup": walltime_improvement(min(alpha, 0.999999), optimal_gamma(min(alpha, 0.999999), c), c),
            "optimal_gamma_corrected": max(corrected, key=corrected.get) if corrected else None,
            "optimal_speedup_corrected": max(corrected.values()) if corrected else None,
            "best_measured_gamma": best_measured["gamma"], "best_measured_speedup": _measured(best_measured)}


def _measured(row: dict) -> float:
    """The speedup to set beside Thm 3.8: over our own plain decoding when it ran (the theorem's
    baseline is the same target step), else over the transformers baseline."""
    return row.get("speedup_vs_plain", row["speedup"]["all"])


LLAMA_TARGET = ("specdecode bench compares with transformers' generate on the same model, which a target on "
                "llama.cpp does not have: pass --backend torch, or run benchmarks/vs_llamacpp.py for the "
                "comparison with llama.cpp's own decoding")


def check_benchable(decoder) -> None:
    """Raises ValueError for a decoder bench cannot compare with transformers: an encoder–decoder
    pair (not supported yet) or a target on llama.cpp."""
    if decoder.pair.is_encoder_decoder:
        raise ValueError("specdecode bench measures decoder-only pairs; encoder-decoder pairs are not supported yet")
    if not hasattr(decoder.target.backend, "model"):
        raise ValueError(LLAMA_TARGET)


def bench_report(decoder, tasks: list[str], prompts_per_task: int, *, new_tokens: int, repeats: int,
                 gammas: list[int], sampling: SamplingParams, hf_schedules: list[str], out: str,
                 hf_drafts: dict | None = None, lenience: list[float] = (), batch_sizes: list[int] = (),
                 headline: bool = False, compare_verification: bool = False, tree_widths: list[int] = (),
                 progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Run the benchmark and write OUT.{json,md} and OUT_*.png. Raises ValueError for an
    encoder–decoder pair (not supported yet) or a target on llama.cpp (no transformers model to
    compare with). Returns {"meta", "costs", "rows",
    "theory", "batch"}. batch_sizes: also time batched plain and speculative decoding (the decoder as
    configured) at these batch sizes (specdecode.measure.batch_bench). compare_verification,
    tree_widths: see build_configs."""
    from specdecode.measure.data import load_prompts
    from specdecode.measure.plots import (
        plot_expected_tokens,
        plot_optimal_gamma,
        plot_speedup_vs_gamma,
    )
    from specdecode.measure.report import environment, fmt, markdown_table, write

    check_benchable(decoder)
    prompts = [(task, decoder.requests.encode(p.text, chat=None if p.chat else False))
               for task in tasks for p in load_prompts(task, prompts_per_task)]
    max_k = max(gammas + [decoder.num_speculative_tokens]) + 1
    draft = decoder.draft.backend if decoder.draft is not None else None
    costs = measure_costs(decoder.target.backend, draft, prompts[0][1], list(range(1, max_k + 1)))
    configs = build_configs(decoder, new_tokens, sampling, gammas, hf_schedules, hf_drafts, lenience, headline,
                            compare_verification, tree_widths)
    timings = run_configs(configs, prompts, repeats, progress)
    rows = summarize(timings, costs, tasks)
    best = theory(rows, costs, max_k)

    meta = environment(target=decoder.target.name, draft=decoder.draft.name if decoder.draft else None,
                       dtype=str(decoder.pair.dtype).removeprefix("torch."), temperature=sampling.temperature,
                       tasks=",".join(tasks), prompts_per_task=prompts_per_task, new_tokens=new_tokens,
                       repeats=repeats, verification=decoder.decoder_config.verification, tree_width=decoder.decoder_config.tree_width)
    body = [f"c = draft step / target step = {fmt(costs.get('c'), 3)} (target step {costs['target_step_s'] * 1000:.0f} ms"
            + (f", draft step {costs['draft_step_s'] * 1000:.0f} ms" if "draft_step_s" in costs else "") + "); "
            "verify cost r(k) = T(k tokens) / T(1 token): "
            + ", ".join(f"r({k}) = {v:.2f}" for k, v in costs["r"].items()), ""]
    speed_cols = ["all"] + tasks if len(tasks) > 1 else ["all"]
    has_plain = any("speedup_vs_plain" in r for r in rows)
    body += ["Speedup = tokens/s over the baseline's, median over repeats of the per-repeat ratio. "
             "α̂ = accepted / (accepted + rejected); Thm 3.8 uses the measured α̂ and c; the corrected "
             "prediction divides by γc + r(γ+1) instead of γc + 1. Both predict the speedup over our own "
             "plain decoding ('vs our plain'). EOS is masked on every side, so all write exactly the "
             "same number of tokens.", ""]
    table = []
    for r in rows:
        table.append([r["config"], fmt(r["tokens_per_s"]["all"])] + [f"{r['speedup'][t]:.2f}x" for t in speed_cols]
                     + ([f"{r['speedup_vs_plain']:.2f}x"] if has_plain else [])
                     + [fmt(r.get("alpha_hat")), fmt(r.get("tokens_per_call")), fmt(r.get("eq1_tokens_per_call")),
                        fmt(r.get("predicted")), fmt(r.get("predicted_corrected")),
                        f"{r['draft_share_of_time']:.0%}" if "draft_share_of_time" in r else "–",
                        fmt(r.get("target_call_ms"), 0), fmt(r.get("draft_forward_ms"), 0),
                        f"{r['other_share_of_time']:.0%}" if "other_share_of_time" in r else "–",
                        f"{fmt(r['limit_c0'])}x" if "limit_c0" in r else "–",
                        f"{r['same_tokens_as_hf']}/{len(prompts)}"])
    body += markdown_table(["configuration", "tokens/s"] + [f"speedup ({t})" for t in speed_cols]
                           + (["vs our plain"] if has_plain else [])
                           + ["α̂", "tokens/call", "Eq. 1", "Thm 3.8", "Thm 3.8 with r", "draft share",
                              "target call (ms)", "draft forward (ms)", "other share", "limit (c → 0)",
                              "same tokens as target alone"], table)
    body += ["", "Limit (c → 0): Eq. 1 at the row's α̂ and γ_max with a free draft, divided by the measured "
                 "r(γ_max + 1); the gap to it is the draft's time (draft share), dynamic γ stopping short, and "
                 "the loop's own time (other share)."]
    if best:
        body += ["", f"Theory from the sweep's pooled α̂ = {best['alpha_pooled']:.3f} and c = {best['c']:.3f}: "
                     f"optimal γ = {best['optimal_gamma']} ({best['optimal_speedup']:.2f}x); with the measured r(k): "
                     f"γ = {best['optimal_gamma_corrected']} ({fmt(best['optimal_speedup_corrected'])}x). "
                     f"Best measured: γ = {best['best_measured_gamma']} ({best['best_measured_speedup']:.2f}x)."]
        stem = str(out)
        sweep = [{"gamma": r["gamma"], "measured": _measured(r), "predicted": r["predicted"],
                  "predicted_corrected": r["predicted_corrected"], "alpha": r["alpha_hat"],
                  "tokens_per_call": r["tokens_per_call"]} for r in rows if "gamma" in r]
        figures = [plot_speedup_vs_gamma(sweep, stem + "_speedup_vs_gamma.png"),
                   plot_expected_tokens(sweep, stem + "_expected_tokens.png"),
                   plot_optimal_gamma(best["alpha_pooled"], best["c"], stem + "_optimal_gamma.png")]
        body += [""] + [f"![{f.stem}]({f.name})" for f in figures]
    batch = []
    if batch_sizes and draft is not None:
        # As configured: the decoder's proposer, γ, guard (greedy rows) and batch cost model
        batch = batch_throughput(decoder.target.backend, draft, [ids for _, ids in prompts], list(batch_sizes),
                                 new_tokens, decoder.num_speculative_tokens, sampling,
                                 make_proposer=lambda: proposers.for_pair(decoder.pair, decoder.decoder_config, decoder.plan.free_drafts, draft),
                                 guard_costs=decoder.guard_costs if sampling.greedy else None,
                                 batch_guard=decoder.guard_costs is not None)
        body += ["", f"## Batches (the decoder as configured: γ ≤ {decoder.num_speculative_tokens}, its guard and "
                     "batch cost model; one run per setting)", "",
                 "Total tokens/s over all rows; speedup = plain wall time / speculative wall time at the same "
                 "batch size. The paper's speedup assumes spare compute (§3.3); a batch spends it.", ""]
        body += markdown_table(["batch size", "method", "tokens/s", "mean latency per row (s)", "tokens/call",
                                "speedup"],
                               [[b["batch_size"], b["method"], fmt(b["tokens_per_second"]), fmt(b["mean_latency_s"]),
                                 fmt(b["mean_tokens_per_call"]), f"{b['speedup']:.2f}x"] for b in batch])
    data = {"costs": costs, "rows": rows, "theory": best, "batch": batch}
    write(out, "Speculative decoding benchmark", meta, body, data)
    return {"meta": meta, **data}
