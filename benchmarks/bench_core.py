"""Side-by-side speed of the default pair on HumanEval prompts, in one process (issue: core engine).

(a) transformers `generate` with the target alone (the baseline, ratio 1.0)
(b) our plain decoding (same loop, no draft)
(c) our speculative decoding for each γ
(d) transformers assisted generation (`assistant_model=`) on the same pair

Greedy, a fixed number of new tokens (EOS suppressed on every side so all produce the same
count). Every configuration runs every prompt once per repeat, interleaved, so slow periods of the
machine hit all of them alike; tokens/s per repeat = total tokens / total time; we report medians
over repeats and ratios to (a). Writes docs/benchmark_core.{md,json}.

    python benchmarks/bench_core.py --prompts 10 --new-tokens 128 --repeats 3 --gammas 1 2 3 4 5 6
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from specdecode import SamplingParams, zoo
from specdecode.data import humaneval_prompts
from specdecode.decoding import DecodeConfig, run
from specdecode.models import HFCausalLM
from specdecode.proposers import DraftModelProposer, PromptLookupProposer


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10, help="HumanEval prompts (first N)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="repeats (medians are over these)")
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="γ values for (c)")
    parser.add_argument("--variants", nargs="*", metavar="SPEC",
                        default=["g=8,conf=0.4", "g=8,conf=0.4,vocab=32768", "g=8,conf=0.4,vocab=32768,lookup"],
                        help="extra (c) runs: g=MAX_GAMMA[,conf=DRAFT_CONFIDENCE][,vocab=DRAFT_VOCAB_LIMIT][,lookup]")
    parser.add_argument("--hf-assistant-tokens", type=int, nargs="*", default=[4],
                        help="constant num_assistant_tokens settings for (d); the 'heuristic' default always runs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default="docs/benchmark_core", help="output path without extension")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    target_model, tokenizer = zoo.load_zoo_model(zoo.DEFAULT_TARGET, dtype, print)
    draft_model, _ = zoo.load_zoo_model(zoo.DEFAULT_DRAFT, dtype, print)
    target = HFCausalLM(target_model)
    drafts = {None: HFCausalLM(draft_model)}
    prompts = [tokenizer.encode(p["prompt"]) for p in humaneval_prompts(args.prompts)]
    n = args.new_tokens
    greedy = SamplingParams(temperature=0.0)

    def ours(gamma, conf=0.0, vocab=None, lookup=False):
        if vocab not in drafts:
            drafts[vocab] = HFCausalLM(draft_model, vocab_limit=vocab)

        def go(ids):
            proposer = DraftModelProposer(drafts[vocab], conf) if gamma else None
            if lookup:
                proposer = PromptLookupProposer(target.vocab_size, fallback=proposer)
            result = run(target, proposer, ids, DecodeConfig(max_new_tokens=n, sampling=greedy,
                                                              num_speculative_tokens=gamma))
            return result.token_ids, result.stats
        return go

    def hf(assistant=None, schedule=None, tokens=None):
        def go(ids):
            kwargs = {}
            if assistant is not None:
                draft_model.generation_config.num_assistant_tokens_schedule = schedule
                if tokens is not None:
                    draft_model.generation_config.num_assistant_tokens = tokens
                kwargs["assistant_model"] = assistant
            with torch.inference_mode():
                out = target_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                            do_sample=False, pad_token_id=tokenizer.eos_token_id, **kwargs)
            return out[0, len(ids):].tolist(), None
        return go

    configs = {"(a) transformers generate, target alone": hf(), "(b) specdecode plain": ours(0)}
    for g in args.gammas:
        configs[f"(c) specdecode speculative γ={g}"] = ours(g)
    for spec in args.variants:
        opts = dict(item.split("=") if "=" in item else (item, "1") for item in spec.split(","))
        configs[f"(c) specdecode speculative {spec}"] = ours(
            int(opts["g"]), float(opts.get("conf", 0)), int(opts["vocab"]) if "vocab" in opts else None,
            "lookup" in opts)
    configs["(d) transformers assisted, heuristic schedule"] = hf(draft_model, "heuristic", 20)
    for t in args.hf_assistant_tokens:
        configs[f"(d) transformers assisted, constant {t}"] = hf(draft_model, "constant", t)

    # Warm-up: one short run of each, so lazy initialisation is not timed.
    for go in configs.values():
        go(prompts[0][:16])
    times = {name: [] for name in configs}
    outputs, stats = {}, {name: [] for name in configs}
    total = args.repeats * len(prompts) * len(configs)
    done = 0
    for rep in range(args.repeats):
        elapsed = {name: 0.0 for name in configs}
        for i, ids in enumerate(prompts):
            for name, go in configs.items():
                t0 = time.perf_counter()
                tokens, st = go(ids)
                elapsed[name] += time.perf_counter() - t0
                assert len(tokens) == n, (name, len(tokens))
                outputs.setdefault(name, {})[i] = tokens
                if st is not None and rep == 0:
                    stats[name].append(st)
                done += 1
                print(f"[{done}/{total}] repeat {rep + 1} prompt {i + 1} {name}: {elapsed[name]:.1f}s so far",
                      file=sys.stderr, flush=True)
        for name in configs:
            times[name].append(len(prompts) * n / elapsed[name])

    baseline = statistics.median(times["(a) transformers generate, target alone"])
    plain_ref = outputs["(b) specdecode plain"]
    hf_ref = outputs["(a) transformers generate, target alone"]
    rows = []
    for name in configs:
        tps = statistics.median(times[name])
        st = stats[name]
        drafted = sum(s.num_drafted for s in st)
        row = {"config": name, "tokens_per_s_median": tps, "tokens_per_s_all": times[name],
               "speedup_vs_a": tps / baseline,
               "prompts_equal_to_our_plain": sum(outputs[name][i] == plain_ref[i] for i in plain_ref),
               "prompts_equal_to_hf_generate": sum(outputs[name][i] == hf_ref[i] for i in hf_ref)}
        if drafted:
            row["acceptance_rate"] = sum(s.num_accepted for s in st) / drafted
            row["mean_tokens_per_call"] = sum(s.num_generated for s in st) / sum(s.num_target_calls for s in st)
            row["draft_share_of_time"] = sum(s.time_draft_s for s in st) / sum(s.wall_time_s for s in st)
        rows.append(row)

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": cpu_name(),
            "cores": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "dtype": args.dtype, "prompts": len(prompts),
            "new_tokens": n, "repeats": args.repeats, "command": "python " + " ".join(sys.argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# Core benchmark: default pair, HumanEval, greedy\n",
             "| " + " | ".join(f"{k}: {v}" for k, v in meta.items() if k != "command") + " |\n",
             f"Command: `{meta['command']}`\n",
             "| configuration | tokens/s (median) | speedup vs (a) | acceptance | tokens/target call | draft share of time | same tokens as (b) / (a) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else "–"
        mtc = f"{r['mean_tokens_per_call']:.2f}" if "mean_tokens_per_call" in r else "–"
        share = f"{r['draft_share_of_time']:.0%}" if "draft_share_of_time" in r else "–"
        lines.append(f"| {r['config']} | {r['tokens_per_s_median']:.2f} | {r['speedup_vs_a']:.2f}x | {acc} | {mtc} "
                     f"| {share} | {r['prompts_equal_to_our_plain']}/{len(prompts)} , {r['prompts_equal_to_hf_generate']}/{len(prompts)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
