"""Decoding beside other CPU-bound processes: the default decoder with its thread governor (fewer
compute threads while others keep cores busy) and without it (torch's thread count throughout),
interleaved in one process, with 0, 1, ... busy processes (`yes > /dev/null`) beside it.

    python benchmarks/threads_under_load.py --busy 0 1 2 --out docs/results/threads_under_load

Greedy, a HumanEval-style prompt, --new-tokens per run; medians of --repeats runs per setting.
"""
import argparse
import datetime
import json
import statistics
import subprocess
import sys

import torch

from specdecode import SpeculativeDecoder
from specdecode.engine.threads import ThreadGovernor
from specdecode.sampling import SamplingParams
from specdecode.tune.hardware import cpu_report, describe

PROMPT = "def quicksort(items):"


def decode(decoder, new_tokens: int, governor: bool, threads: int) -> tuple[float, int]:
    """(tokens/s, threads at the end) of one greedy run."""
    torch.set_num_threads(threads)
    decoder.engine.threads = ThreadGovernor(max_threads=threads) if governor else None
    result = decoder.generate(PROMPT, chat=False, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0))
    return result.stats.num_generated / result.stats.wall_time_s, torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside it")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    threads, report = torch.get_num_threads(), cpu_report()
    decoder = SpeculativeDecoder()
    decode(decoder, 16, False, threads)  # warm-up
    rows = []
    for busy in args.busy:
        others = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(busy)]
        try:
            runs = {"governor": [], "fixed": []}
            ends = []
            for _ in range(args.repeats):
                for name in ("fixed", "governor"):
                    rate, end = decode(decoder, args.new_tokens, name == "governor", threads)
                    runs[name].append(rate)
                    ends.append(end) if name == "governor" else None
        finally:
            for process in others:
                process.kill()
                process.wait()
        on, off = statistics.median(runs["governor"]), statistics.median(runs["fixed"])
        rows.append({"busy": busy, "governor": on, "fixed": off, "ratio": on / off, "governor_threads": ends,
                     "runs": runs})
        print(f"{busy} busy: governor {on:.1f} tokens/s (threads at the end {ends}), fixed {threads} threads "
              f"{off:.1f}, {on / off:.2f}x", flush=True)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": describe(report), "capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "python": sys.version.split()[0], "threads": threads,
              "configuration": decoder.configuration(), "command": "python " + " ".join(sys.argv),
              "new_tokens": args.new_tokens, "repeats": args.repeats}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1, default=str)
        lines = ["# Decoding beside busy processes: the thread governor on and off", "",
                 f"Date {header['date']}; {header['machine']}; torch {header['torch']}, Python {header['python']}.",
                 f"Command: `{header['command']}`", "",
                 f"The default decoder, greedy, {args.new_tokens} tokens per run, medians of {args.repeats} "
                 "runs per setting, the two settings interleaved in one process.", "",
                 "| busy processes | governor (tokens/s) | threads it ended on | fixed threads (tokens/s) | ratio |",
                 "|---|---|---|---|---|"]
        lines += [f"| {r['busy']} | {r['governor']:.1f} | {r['governor_threads']} | {r['fixed']:.1f} | "
                  f"{r['ratio']:.2f}x |" for r in rows]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
