"""Suffix drafts against prompt lookup, each in front of the default draft model, on four
workloads sent as a user's sequence of requests (greedy, one request at a time, so the suffix
cache holds the earlier requests' outputs):

- edits: HumanEval functions, each rewritten twice (type hints, then a docstring): outputs repeat
  the prompt, and the second request repeats much of the first's output;
- agent: requests for a JSON tool call in one fixed format: outputs share their structure;
- spec_bench: Spec-Bench questions (qa, summarization, rag, math reasoning): general text;
- completion: HumanEval prompts continued as raw code (no chat template).

Every proposer decodes every request (interleaved: request i with each before request i+1), in one
process; the report gives tokens/s, mean tokens per target call and the share of steps whose
drafts were free (lookup), per workload, and the ratio suffix / lookup.

    python benchmarks/suffix_drafts.py --requests 6 --new-tokens 64 --out docs/results/suffix_drafts.md
    python benchmarks/suffix_drafts.py --requests 1 --new-tokens 8               # smoke
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.engine.driver import Driver
from specdecode.engine.engine import Engine
from specdecode.measure.data import humaneval_prompts, load_prompts
from specdecode.tune.hardware import cpu_report
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer, SuffixProposer

TOOLS = ["find flights from Paris to Rome on 3 May", "the weather in Oslo tomorrow",
         "convert 250 US dollars to euros", "the population of Canada in 2020", "open issues in the numpy repo",
         "a vegetarian lasagna recipe", "the distance from Berlin to Munich", "today's top science headline"]
AGENT = ('You are a tool-calling agent. Reply with one JSON object only, exactly in this form: '
         '{"tool": "<search|weather|convert|lookup>", "arguments": {"query": "<the request>", "max_results": 5}, '
         '"reason": "<one short sentence>"}. The user asks for: ')


def workloads(count: int) -> dict[str, tuple[list[str], bool]]:
    """{name: (prompts, through the chat template)}."""
    functions = [p["prompt"] for p in humaneval_prompts(max(count, (count + 1) // 2))]
    edits = [f"Rewrite this Python function {how}. Reply with the code only.\n\n{code}"
             for code in functions for how in ("adding type hints", "adding a docstring")][:count]
    agent = [AGENT + TOOLS[i % len(TOOLS)] for i in range(count)]
    tasks = ["qa", "summarization", "rag", "math_reasoning"]
    per_task = {task: load_prompts(task, (count + len(tasks) - 1) // len(tasks)) for task in tasks}
    spec_bench = [per_task[tasks[i % len(tasks)]][i // len(tasks)].text for i in range(count)]
    return {"edits": (edits, True), "agent": (agent, True), "spec_bench": (spec_bench, True),
            "completion": (functions[:count], False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per workload")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None, help="write the markdown report here too")
    args = parser.parse_args()
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    decoder = SpeculativeDecoder(dtype=args.dtype, progress=progress, guard=False)
    greedy = SamplingParams(temperature=0)
    kinds = ("ngram", "suffix")
    vocab = decoder.target.backend.vocab_size

    def proposer(kind):
        fallback = DraftModelProposer(decoder.draft.backend, decoder.decoder_config.draft_confidence)
        if kind == "ngram":
            return FallbackProposer(PromptLookupProposer(vocab), fallback)
        return FallbackProposer(SuffixProposer(vocab), fallback)

    rows = []
    for name, (prompts, chat) in workloads(args.requests).items():
        drivers = {kind: Driver(Engine(decoder.target.backend, proposer(kind), decoder.tokenizer,
                                       first_step_plain=True)) for kind in kinds}
        totals = {kind: [0, 0.0, 0, 0, 0] for kind in kinds}  # tokens, seconds, target calls, lookup steps, steps
        texts = {kind: [] for kind in kinds}
        for index, prompt in enumerate(prompts):
            for kind in kinds:
                request = decoder.requests.request(decoder.requests.encode(prompt, chat), decoder.requests.config(args.new_tokens, greedy))
                start = time.perf_counter()
                result = drivers[kind].result(drivers[kind].submit(request))
                seconds = time.perf_counter() - start
                total = totals[kind]
                total[0] += len(result.token_ids)
                total[1] += seconds
                total[2] += result.stats.num_target_calls
                total[3] += result.stats.num_lookup_steps
                total[4] += result.stats.num_target_calls
                texts[kind].append(result.token_ids)
            progress(f"{name}: request {index + 1}/{len(prompts)} done")
        same = all(texts[kind] == texts["ngram"] for kind in kinds)
        rates = {kind: totals[kind][0] / totals[kind][1] for kind in kinds}
        for kind in kinds:
            tokens, seconds, calls, lookups, steps = totals[kind]
            rows.append(f"| {name} | {kind} | {tokens} | {rates[kind]:.2f} | {tokens / calls:.2f} | "
                        f"{lookups / steps:.0%} | {rates[kind] / rates['ngram']:.2f} |")
        rows.append(f"| {name} | (outputs equal: {'yes' if same else 'NO'}) | | | | | |")
    header = [
        "# Suffix drafts against prompt lookup", "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {cpu_report()}; "
        f"{platform.processor() or platform.machine()}; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}. Decoder: {decoder.configuration()['dtype']} "
        f"target, γ = {decoder.num_speculative_tokens}, the default draft behind each proposer.", "",
        f"Command: `python benchmarks/suffix_drafts.py --requests {args.requests} --new-tokens {args.new_tokens}"
        f"{'' if args.dtype == 'auto' else ' --dtype ' + args.dtype}`", "",
        f"Greedy, {args.requests} requests per workload, one at a time, up to {args.new_tokens} new tokens each.", "",
        "| workload | free drafts | tokens | tokens/s | tokens per target call | steps with free drafts | "
        "tokens/s vs lookup |", "|---|---|---|---|---|---|---|"]
    report = "\n".join(header + rows) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
