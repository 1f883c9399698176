"""The guard's pause rule, replayed: does it pause drafts that pay?

Records each speculative step (drafts verified, draft forwards, tokens emitted; free drafts
apart) of unguarded greedy requests of the default pair, then replays those steps under a pause
rule with the cost model the guard uses (a plain step costs 1 target step, a speculative one
1 + base + slope·k + c·forwards, engine.guard) and reports each request's replayed speedup over
plain decoding: unguarded, under the current rule (pause where the mean gain is below zero by
more than one standard error, decay 0.9, 3 steps of warm-up), and under the earlier rule (a
5-step mean, 4 steps of warm-up, no margin). A replay, not a timing: it isolates the rule from the
machine's noise (the speed itself is measured by vs_llamacpp.py), at the costs measured at load
and at dearer ones (c = 0.3 and 0.6, where fewer drafts pay), plus drafts that never pay (every
draft rejected, 1-3 drafted a step).

Free drafts are verified whole (the guard's pricing of them is not replayed) and do not count
towards a pause. A paused stretch decodes plainly; the replay then continues with the first recorded step that
starts at or after the position reached (the recorded steps are greedy, so the text is the same;
which steps follow a pause is approximate).

    python benchmarks/guard_replay.py --prompts 18 --out docs/results/guard_replay
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

from specdecode import SamplingParams, SpeculativeDecoder  # noqa: E402
from specdecode.engine import policy  # noqa: E402
from specdecode.engine.guard import SpeculationGuard  # noqa: E402
from specdecode.measure.report import environment, markdown_table, write  # noqa: E402
from specdecode.proposers import SuffixProposer, find_proposer  # noqa: E402
from vs_llamacpp import workloads  # noqa: E402

RULES = {"current": {}, "earlier (5-step mean, no margin)": dict(decay=0.8, warmup=4, margin=0.0)}


def record(decoder: SpeculativeDecoder, prompt: list[int], new_tokens: int) -> list[tuple[int, int, int, bool]]:
    """The request's steps, unguarded: (drafts verified, draft forwards, tokens emitted, free draft)."""
    steps = []
    original = policy.GammaPolicy.record

    def spy(self, planned, drafted, accepted, draft):
        original(self, planned, drafted, accepted, draft)
        steps.append((drafted, draft.forwards, accepted + 1, bool(draft.lookup)))

    find_proposer(decoder.engine.proposer, SuffixProposer).forget()
    costs, decoder.requests.guard_costs = decoder.requests.guard_costs, None  # unguarded
    policy.GammaPolicy.record = spy
    try:
        decoder.generate(prompt, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0, ignore_eos=True))
    finally:
        policy.GammaPolicy.record = original
        decoder.requests.guard_costs = costs
    return steps


def replay(steps, costs, rule: dict | None) -> float:
    """Replayed speedup over plain decoding (tokens per unit of target-step cost)."""
    c, slope, base = costs
    guard = SpeculationGuard(c, slope, base, **rule) if rule is not None else None
    starts = [0]
    for step in steps:
        starts.append(starts[-1] + step[2])
    total, position, cost, i = starts[-1], 0, 0.0, 0
    while position < total:
        while starts[i] < position:
            i += 1
        if i == len(steps):  # inside the last recorded step: the rest plainly
            cost += total - position
            break
        drafted, forwards, emitted, free = steps[i]
        # the engine asks the guard before it knows whether a free draft will come: a pause
        # stops free drafts too
        if (guard is None or guard.speculate()) and drafted:
            cost += 1 + base + slope * drafted + c * forwards
            position += emitted
            if guard is not None and not free:
                guard.record(drafted, forwards, emitted)
        else:
            cost += 1
            position += 1
    return total / cost


def never_pays(count: int = 60) -> list[tuple[int, int, int, bool]]:
    """Steps of a draft whose every token is rejected, 1-3 drafted a step."""
    return [(d, d, 1, False) for d in ([1, 1, 2, 3] * count)[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=18, help="Spec-Bench prompts (3 per category at 18)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    if args.prompts < 1 or args.new_tokens < 1:
        parser.error("--prompts and --new-tokens must be >= 1")
    decoder = SpeculativeDecoder()
    measured = tuple(decoder.guard_costs) + (0.0,) * (3 - len(decoder.guard_costs))
    requests = {f"spec_bench {i}": record(decoder, prompt, args.new_tokens)
                for i, prompt in enumerate(workloads(args.prompts, decoder.tokenizer)["spec_bench"])}
    requests["a draft that never pays"] = never_pays()
    regimes = {f"measured (c {measured[0]:.2f}, slope {measured[1]:.3f}, base {measured[2]:.3f})": measured,
               "c 0.3, slope 0.1, base 0.1": (0.3, 0.1, 0.1), "c 0.6, slope 0.22, base 0.18": (0.6, 0.22, 0.18)}
    results, body = {}, []
    for regime, costs in regimes.items():
        table = {name: {"unguarded": replay(steps, costs, None),
                        **{rule: replay(steps, costs, options) for rule, options in RULES.items()}}
                 for name, steps in requests.items()}
        results[regime] = table
        columns = ["unguarded", *RULES]
        paying = [row for name, row in table.items() if name.startswith("spec_bench")]
        rows = [[name] + [f"{row[c]:.2f}x" for c in columns] for name, row in table.items()]
        rows.append(["geometric mean, Spec-Bench"] + [
            f"{math.exp(statistics.mean(math.log(row[c]) for row in paying)):.2f}x" for c in columns])
        body += [f"## Costs: {regime}", "", *markdown_table(["request", *columns], rows), ""]
    meta = environment(prompts=f"Spec-Bench {args.prompts}", new_tokens=args.new_tokens, dtype="auto", temperature=0)
    meta["command"] = f"python benchmarks/guard_replay.py --prompts {args.prompts} --out {args.out}"
    write(args.out, "the guard's pause rule, replayed over recorded steps", meta, body,
          {"costs": regimes, "replayed_speedup": results, "steps": requests})
    print("\n".join(body))


if __name__ == "__main__":
    main()
