#!/usr/bin/env bash
# Every measurement quoted in README.md and docs/REPRODUCTION.md, in one command (about 75 min on
# 2 idle cores; keep the machine otherwise idle while it runs). Each step writes docs/<name>.{md,json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { echo "== $(date -u +%H:%M:%S) specdecode $*" >&2; specdecode "$@" --quiet > /dev/null; }

# Issue-4 goal: HumanEval, 20 prompts x 128 tokens, greedy, against transformers generate and
# transformers assisted generation (its best setting measured here: constant 4, with either draft).
run bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline \
    --hf-draft float ours --hf-assisted constant:4@float constant:4@ours heuristic@ours --out docs/bench_code_t0
# Exact sampling at temperature 1.
run bench --tasks code --prompts 10 --new-tokens 128 --repeats 1 --gammas --headline --temperature 1 \
    --hf-assisted none --out docs/bench_code_t1
# Spec-Bench categories (translation and summarization are the paper's tasks).
run bench --tasks translation summarization qa math_reasoning rag --prompts 3 --new-tokens 128 --repeats 1 \
    --gammas --headline --hf-assisted none --out docs/bench_spec_bench_t0
# Theorem 3.8 vs measurement over a γ sweep, lenience (lossy) and batches.
run bench --tasks code --prompts 4 --new-tokens 128 --repeats 1 --gammas 1 2 3 4 6 --headline \
    --hf-assisted none --lenience 0.5 0.3 0.1 --batch-size 1 2 4 --out docs/bench_gamma_sweep
# α the paper's way and empirically, per task, temperature and draft (paper Tables 3 and 5).
run alpha --tasks code translation summarization --prompts 4 --max-new-tokens 128 -k 4 \
    --lenience 0.5 0.3 0.1 --out docs/alpha
echo "== $(date -u +%H:%M:%S) done" >&2
