#!/usr/bin/env bash
# The measurements of the 2026-12-01 round (issues 11-14), in one command, about 2 hours on 2 idle
# cores; keep the machine otherwise idle while it runs. Each step writes docs/results/<name>.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== $(date -u +%H:%M:%S) $*" >&2; "$@" > /dev/null; }

# Server under load: speculative vs --draft none at concurrency 1, 2, 4, 8.
step python benchmarks/serve_load.py --max-tokens 128 --requests-per-client 4 --out docs/results/serve_load
# HumanEval greedy with the defaults, token trees of width 2 and 3, and transformers assisted
# generation given our int4 draft object.
step specdecode bench --tasks code --prompts 10 --new-tokens 128 --repeats 1 --gammas --headline \
    --tree-widths 2 3 --hf-draft ours --hf-assisted heuristic@ours --out docs/results/bench_round2_code_t0 --quiet
# Exact sampling at temperature 1: token-wise against block verification, and a tree.
step specdecode bench --tasks code --prompts 6 --new-tokens 128 --repeats 1 --gammas --headline --temperature 1 \
    --compare-verification --tree-widths 2 --hf-assisted none --out docs/results/bench_round2_code_t1 --quiet
# The issue-13 goals on the prompt counts they name: HumanEval greedy, 20 prompts, the defaults, a
# width-2 tree and transformers given our int4 draft object; HumanEval at temperature 1, 20 prompts;
# all six Spec-Bench categories, 10 prompts each; batches of 1, 2 and 4 with the defaults.
step specdecode bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline --tree-widths 2 \
    --hf-draft ours --hf-assisted heuristic@ours --out docs/results/bench_code_t0_20 --quiet
step specdecode bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline --temperature 1 \
    --compare-verification --hf-assisted none --out docs/results/bench_code_t1_20 --quiet
step specdecode bench --tasks translation summarization qa math_reasoning rag coding --prompts 10 --new-tokens 128 \
    --repeats 1 --gammas --headline --hf-assisted none --out docs/results/bench_specbench10 --quiet
step specdecode bench --tasks code --prompts 4 --new-tokens 128 --repeats 1 --gammas --headline --hf-assisted none \
    --batch-size 1 2 4 --out docs/results/bench_batch_defaults --quiet
# The lean draft forward (models/lean.py): its step time against transformers' forward, and HumanEval
# greedy with it. (The docs above it were measured before it existed; rerun now, they use it too.)
step python benchmarks/lean_draft.py --out docs/results/lean_draft
step specdecode bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline \
    --hf-draft ours --hf-assisted heuristic@ours --out docs/results/bench_code_t0_20_lean --quiet
# Ray Data (1 worker) against the local `specdecode batch`, 40 HumanEval prompts x 64 tokens.
step python benchmarks/ray_batch.py --prompts 40 --max-tokens 64 --repeats 3 --out docs/results/ray_batch
# What logprobs, penalties and a JSON schema cost under speculation.
step python benchmarks/feature_cost.py --prompts 5 --new-tokens 64 --out docs/results/feature_cost.md
