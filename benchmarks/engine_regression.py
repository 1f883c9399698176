"""The engine against the two loops it replaced, side by side in one process (the "no speed
regression" check). The old code is the commit before the engine (5c37114), copied as a package
named `specdecode_old`:

    git worktree add /tmp/oldtree 5c37114 && mkdir -p /tmp/oldpkg && cp -r /tmp/oldtree/specdecode /tmp/oldpkg/specdecode_old \
        && grep -rl specdecode /tmp/oldpkg/specdecode_old | xargs sed -i 's/\\bspecdecode\\b/specdecode_old/g'
    PYTHONPATH=/tmp/oldpkg python benchmarks/engine_regression.py --prompts 20 --new-tokens 128 \
        --out docs/results/engine_regression

Configurations, interleaved per prompt (bench.run_configs): transformers `generate` with the
target alone (the baseline), the old loop as configured, the new engine as configured; all with
the default pair, greedy, EOS masked as `specdecode bench` does. Then the new engine's batch
throughput at batch 1, 2, 4 (bench.batch_throughput).
"""

import argparse

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure import bench
from specdecode.measure.batch_bench import batch_throughput
from specdecode.measure.data import load_prompts
from specdecode.measure.report import environment, fmt, markdown_table, write


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--batch-prompts", type=int, default=4)
    parser.add_argument("--batch-new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import specdecode_old
    from specdecode_old.measure.bench import build_configs as old_build_configs

    greedy = SamplingParams(temperature=0.0)
    new = SpeculativeDecoder()
    old = specdecode_old.SpeculativeDecoder()
    prompts = [(p.task, new.encode(p.text, chat=None if p.chat else False)) for p in load_prompts("code", args.prompts)]
    configs = bench.build_configs(new, args.new_tokens, greedy, [], [], headline=True)
    configs["new engine, as configured"] = configs.pop("specdecode as configured")
    old_configs = old_build_configs(old, args.new_tokens, specdecode_old.SamplingParams(temperature=0.0), [], [],
                                    headline=True)
    configs["old loops, as configured"] = old_configs["specdecode_old as configured"]  # the copy renamed its strings too
    timings = bench.run_configs(configs, prompts, repeats=1,
                                progress=lambda d, t, what: print(f"{d}/{t} {what}", flush=True))
    rows = bench.summarize(timings, {}, ["code"])
    batch = batch_throughput(new.target.backend, new.draft.backend, [ids for _, ids in prompts[:args.batch_prompts]],
                             args.batch_sizes, args.batch_new_tokens, new.num_speculative_tokens, greedy,
                             draft_confidence=new.draft_confidence)
    ratio = next(r for r in rows if r["config"].startswith("new"))["speedup"]["all"] / \
        next(r for r in rows if r["config"].startswith("old"))["speedup"]["all"]
    body = ["Speedup = tokens/s over transformers `generate` with the target alone, same prompts, interleaved.", ""]
    body += markdown_table(["configuration", "tokens/s", "speedup", "α̂", "tokens/call", "target call (ms)",
                            "draft forward (ms)", "same tokens as target alone"],
                           [[r["config"], fmt(r["tokens_per_s"]["all"]), f"{fmt(r['speedup']['all'])}x",
                             fmt(r.get("alpha_hat")), fmt(r.get("tokens_per_call")), fmt(r.get("target_call_ms"), 0),
                             fmt(r.get("draft_forward_ms"), 0), f"{r['same_tokens_as_hf']}/{len(prompts)}"] for r in rows])
    body += ["", f"New engine / old loops (speedup ratio): **{ratio:.3f}**", "",
             f"Batch throughput of the new engine ({args.batch_prompts} HumanEval prompts cycled, "
             f"{args.batch_new_tokens} tokens per row, greedy, EOS ignored: every row runs to its length):", ""]
    body += markdown_table(["batch size", "method", "tokens/s", "speedup over plain at this batch size",
                            "tokens/call", "acceptance rate"],
                           [[b["batch_size"], b["method"], fmt(b["tokens_per_second"]), f"{fmt(b['speedup'])}x",
                             fmt(b["mean_tokens_per_call"]), fmt(b["acceptance_rate"])] for b in batch])
    meta = environment(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", dtype="bfloat16",
                       prompts=args.prompts, new_tokens=args.new_tokens)
    meta["command"] = "PYTHONPATH=/tmp/oldpkg python benchmarks/engine_regression.py " + \
        f"--prompts {args.prompts} --new-tokens {args.new_tokens} --out {args.out}"
    write(args.out, "The engine against the old loops", meta, body, {"rows": rows, "batch": batch, "ratio": ratio})
    print("\n".join(body))


if __name__ == "__main__":
    main()
