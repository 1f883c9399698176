"""`specdecode batch` on Ray Data (1 worker) against the local `specdecode batch`, side by side
(the goal: the Ray run within 10% of the local run's tokens/s).

The same input (the first --prompts HumanEval prompts, raw, greedy, --max-tokens tokens each) is
decoded by the two commands as a user runs them, alternately, --repeats times each, each run into
a fresh output file. Measured per run: completion tokens (from the output file), the command's
wall time from start to exit (model loading included in both; the Ray run also starts a local
cluster and its actor), and tokens/s = tokens / wall time. Reported: medians and the ratio
Ray / local, and the job's own summary line (the local one excludes model loading).

    python benchmarks/ray_batch.py --out docs/results/ray_batch
    python benchmarks/ray_batch.py --prompts 2 --max-tokens 8 --repeats 1 --out /tmp/ray_batch_smoke  # smoke
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdecode.measure.data import humaneval_prompts
from specdecode.measure.report import environment, fmt, markdown_table, write

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], out: Path) -> dict:
    """Runs one `specdecode batch` command to the end; its tokens, wall time and summary line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    records = [json.loads(line) for line in out.read_text().split("\n") if line]
    errors = [r for r in records if "error" in r]
    if errors:
        raise RuntimeError(f"rows failed: {errors[:3]}")
    tokens = sum(r["usage"]["completion_tokens"] for r in records)
    summary = next((line for line in done.stderr.splitlines() if "rows done" in line), "")
    # decoding only: the local job's own rate (its decoder is built before the job starts), or the
    # Ray job's rate over the time its worker decoded (after the cluster start and model loading)
    decoding = re.search(r"([\d.]+) tokens/s over the", summary) or re.search(r"([\d.]+) tokens/s\)", summary)
    return {"rows": len(records), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": float(decoding[1]), "summary": summary.removeprefix("specdecode: "),
            "texts": {str(r["id"]): r["text"] for r in records}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--rows-per-task", type=int, default=None,
                        help="the Ray run's --rows-per-task (default: --prompts: the one worker decodes the whole "
                             "set as one continuous batch, as the local run does)")
    parser.add_argument("--model-args", default="",
                        help="extra model flags for both commands, e.g. '--target DIR --draft DIR' (default: the "
                             "default pair)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ray_batch_"))
    data = work / "humaneval.jsonl"
    data.write_text("".join(json.dumps({"id": p["task_id"], "prompt": p["prompt"]}) + "\n"
                            for p in humaneval_prompts(args.prompts)))
    common = ["--raw", "--temperature", "0", "--max-tokens", str(args.max_tokens),
              "--max-batch-size", str(args.max_batch_size), *shlex.split(args.model_args)]
    ray_flags = ["--ray", "--workers", "1", "--rows-per-task", str(args.rows_per_task or args.prompts)]
    runs = {"local": [], "ray": []}
    for repeat in range(args.repeats):
        order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")  # spread drift over both
        for kind in order:
            out = work / f"{kind}-{repeat}.jsonl"
            command = [sys.executable, "-m", "specdecode.cli", "batch", str(data), "--output", str(out), *common,
                       *(ray_flags if kind == "ray" else [])]
            result = run(command, out)
            result["command"] = shlex.join(["specdecode", *command[3:]])
            runs[kind].append(result)
            print(f"{kind} #{repeat + 1}: {result['tokens']} tokens in {result['wall_s']:.1f} s "
                  f"({result['tokens_per_s']:.2f} tokens/s); {result['summary']}", file=sys.stderr)
    same = all(r["texts"] == runs["local"][0]["texts"] for r in runs["local"] + runs["ray"])
    median = {kind: statistics.median(r["tokens_per_s"] for r in rs) for kind, rs in runs.items()}
    wall = {kind: statistics.median(r["wall_s"] for r in rs) for kind, rs in runs.items()}
    ratio = median["ray"] / median["local"]
    decoding = {kind: statistics.median(r["decode_tokens_per_s"] for r in rs) for kind, rs in runs.items()}
    decode_ratio = decoding["ray"] / decoding["local"]
    body = [f"{args.prompts} HumanEval prompts (raw) × {args.max_tokens} tokens, greedy, --max-batch-size "
            f"{args.max_batch_size}; the Ray run: a local cluster started by the command, 1 worker, --rows-per-task "
            f"{args.rows_per_task or args.prompts}. Wall time = the command from start to exit (model loading "
            "in both; Ray's cluster start and actor in the Ray run). Medians of "
            f"{args.repeats} runs each, alternating.", ""]
    body += markdown_table(["run", "tokens/s end to end (median)", "wall s (median)", "runs (tokens/s)",
                            "tokens/s while decoding (median)", "runs (tokens/s while decoding)"],
                           [[kind, fmt(median[kind]), fmt(wall[kind], 1),
                             ", ".join(fmt(r["tokens_per_s"]) for r in runs[kind]), fmt(decoding[kind]),
                             ", ".join(fmt(r["decode_tokens_per_s"]) for r in runs[kind])] for kind in runs])
    body += ["", f"Ray / local tokens/s end to end: **{ratio:.3f}**; while decoding: **{decode_ratio:.3f}** (goal: "
                 f">= 0.90). Greedy texts identical in every run: {'yes' if same else 'NO'}.", "",
             "End to end = completion tokens / the command's wall time. While decoding = the job's own rate: the "
             "local job's time (its decoder is built before the job starts) and the Ray job's time with the worker "
             "decoding (from its first batch's start to its last one's end, after the cluster start and the "
             "worker's model loading).", "", "Commands:", ""]
    body += [f"- {kind}: `{runs[kind][0]['command']}`" for kind in runs]
    body += ["", "Job summaries (the local job's time excludes model loading; the Ray job's includes the cluster "
                 "start and the actor's model loading):", ""]
    body += [f"- {kind} #{i + 1}: {r['summary']}" for kind in runs for i, r in enumerate(runs[kind])]
    import ray

    meta = environment(ray=ray.__version__, model_args=args.model_args or "default pair", cpus=os.cpu_count(),
                       command=shlex.join(["python", "benchmarks/ray_batch.py", *sys.argv[1:]]))
    for rs in runs.values():
        for r in rs:
            del r["texts"]
    write(args.out, "specdecode batch: Ray Data (1 worker) vs local", meta, body,
          {"runs": runs, "median_tokens_per_s": median, "ratio": ratio, "median_decode_tokens_per_s": decoding,
           "decode_ratio": decode_ratio, "same_texts": same})


if __name__ == "__main__":
    main()
