"""The draft's forward: transformers' against the lean one (specdecode/models/lean.py), side by
side in one process, on the default pair's draft as the decoder prepares it (int4, eager
attention, the limited head).

For each shape (rows × context): both backends read the same prompts, then each runs one-token
draft steps, greedy on its own logits; alternating backends, --repeats rounds. Reported: the
median step time of each, the ratio, and whether the two chose the same tokens (they should:
the lean forward computes transformers' arithmetic).

    python benchmarks/lean_draft.py --out docs/results/lean_draft
"""

import argparse
import shlex
import statistics
import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.measure.report import environment, fmt, markdown_table, write
from specdecode.models import HFCausalLM


def steps(backend, prompts: list[list[int]], n: int) -> tuple[list[float], list[list[int]]]:
    """Reads the prompts (one row each), then n one-token steps; (step times s, tokens per row)."""
    backend.reset()
    for prompt in prompts:
        backend.add_row(None, prompt)
    feeds, times, chosen = [[p[-1]] for p in prompts], [], [[] for _ in prompts]
    for _ in range(n):
        start = time.perf_counter()
        logits = backend.forward(feeds, 1)
        times.append(time.perf_counter() - start)
        feeds = [[int(t)] for t in logits[:, -1].argmax(-1)]
        for row, feed in zip(chosen, feeds):
            row.append(feed[0])
    return times, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[150, 1000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    decoder = SpeculativeDecoder(guard=False)
    draft = decoder.draft.backend
    backends = {"transformers": HFCausalLM(draft.model, draft.vocab_size),
                "lean": HFCausalLM(draft.model, draft.vocab_size, lean=True)}
    rows_out, data = [], []
    for rows in args.rows:
        for context in args.contexts:
            prompts = [[(i * 7919 + r * 104729) % 30000 for i in range(context)] for r in range(rows)]
            medians = {name: [] for name in backends}
            tokens = {}
            for _ in range(args.repeats):
                for name, backend in backends.items():
                    times, tokens[name] = steps(backend, prompts, args.steps)
                    medians[name].append(statistics.median(times) * 1000)
            hf, lean = statistics.median(medians["transformers"]), statistics.median(medians["lean"])
            same = sum(a == b for ra, rb in zip(tokens["transformers"], tokens["lean"]) for a, b in zip(ra, rb))
            total = rows * args.steps
            rows_out.append([rows, context, fmt(hf, 1), fmt(lean, 1), f"{lean / hf:.2f}", f"{same}/{total}"])
            data.append({"rows": rows, "context": context, "transformers_ms": medians["transformers"],
                         "lean_ms": medians["lean"], "same_tokens": same, "tokens": total})
            print(rows_out[-1], flush=True)
    body = [f"One-token draft steps after reading prompts of the given length (synthetic token ids), greedy on "
            f"each backend's own logits, {args.steps} steps; median step time per round, median over "
            f"{args.repeats} alternating rounds.", ""]
    body += markdown_table(["rows", "context", "transformers (ms)", "lean (ms)", "lean / transformers",
                            "same tokens"], rows_out)
    write(args.out, "The draft's forward: transformers against the lean one",
          environment(command=shlex.join(["python", "benchmarks/lean_draft.py", *sys.argv[1:]])),
          body, {"shapes": data})


if __name__ == "__main__":
    main()
