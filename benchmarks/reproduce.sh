#!/usr/bin/env bash
# Every measurement quoted in docs/REPRODUCTION.md and in docs/speed.md's first speed round and CPU
# classes, in one command (about 3 hours on 2 idle cores; keep the machine otherwise idle while it
# runs). Each step writes docs/results/<name>.{md,json,png}.
# Runs measured with the defaults of an earlier time spell those defaults out as flags (-k 8
# --gamma-schedule fixed, --quantize-draft int8). The int8 runs also had the guard of that time,
# which averaged per-step costs and paused a winning draft now and then (fixed since; see
# specdecode/guard.py): rerun, they come out the same or a little faster.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { echo "== $(date -u +%H:%M:%S) specdecode $*" >&2; specdecode "$@" --quiet > /dev/null; }

# The defaults (int4 draft, γ ≤ 8 fixed, confidence 0.4, prompt lookup, guard): HumanEval, 20 prompts
# x 128 tokens, greedy, against transformers assisted generation with the pair as given (its default
# constant:20, its heuristic schedule, constant:4) and given our int4 draft object.
run bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline \
    --hf-draft float ours --hf-assisted constant:20@float heuristic@float constant:4@float heuristic@ours \
    --out docs/results/bench_code_t0_int4
# The paper's tasks with the defaults.
run bench --tasks translation summarization --prompts 4 --new-tokens 128 --repeats 1 --gammas --headline \
    --hf-assisted none --out docs/results/bench_spec_bench_t0_int4
# α of the int8 and the int4 draft on the same prompts.
for kind in int8 int4; do
    run alpha --tasks code translation summarization --prompts 4 --max-new-tokens 96 --quantize-draft $kind \
        --out docs/results/alpha_$kind
done
# Draft quantization x confidence x γ schedule on held-out HumanEval prompts 20-24.
echo "== $(date -u +%H:%M:%S) python benchmarks/tune_draft.py" >&2
python benchmarks/tune_draft.py > /dev/null

# HumanEval, 20 prompts x 128 tokens, greedy: the adaptive schedule against transformers assisted
# generation given the same int8 draft object (its heuristic schedule: its best in the run below).
run bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline -k 16 --gamma-schedule adaptive \
    --quantize-draft int8 --hf-draft ours --hf-assisted heuristic@ours --out docs/results/bench_code_t0
# The same prompts with γ ≤ 8 fixed, against transformers with the pair as given and with our draft.
run bench --tasks code --prompts 20 --new-tokens 128 --repeats 1 --gammas --headline -k 8 --gamma-schedule fixed \
    --quantize-draft int8 --hf-draft float ours --hf-assisted constant:4@float constant:4@ours heuristic@ours --out docs/results/bench_code_t0_fixed_gamma8
# Exact sampling at temperature 1 (γ ≤ 8 fixed).
run bench --tasks code --prompts 8 --new-tokens 128 --repeats 1 --gammas --headline --temperature 1 \
    -k 8 --gamma-schedule fixed --quantize-draft int8 --hf-assisted none --out docs/results/bench_code_t1
# Spec-Bench categories (translation and summarization are the paper's tasks; γ ≤ 8 fixed).
run bench --tasks translation summarization qa math_reasoning rag --prompts 2 --new-tokens 128 --repeats 1 \
    --gammas --headline -k 8 --gamma-schedule fixed --quantize-draft int8 --hf-assisted none --out docs/results/bench_spec_bench_t0
# Theorem 3.8 vs measurement over a γ sweep (against our own plain decoding), lenience (lossy), batches.
run bench --tasks code --prompts 3 --new-tokens 128 --repeats 1 --gammas 1 2 3 4 6 -k 8 --gamma-schedule fixed \
    --quantize-draft int8 --hf-assisted none --lenience 0.5 0.1 --batch-size 1 2 --out docs/results/bench_gamma_sweep
# α the paper's way and empirically, per task, temperature and draft (paper Tables 3 and 5).
run alpha --tasks code translation summarization --prompts 3 --max-new-tokens 128 -k 4 --quantize-draft int8 \
    --lenience 0.5 0.3 0.1 --out docs/results/alpha
# γ schedules and prompt lookup on held-out HumanEval prompts 20-24 (chose today's defaults).
echo "== $(date -u +%H:%M:%S) python benchmarks/tune_schedule.py" >&2
python benchmarks/tune_schedule.py > /dev/null
# dtype="auto": the target's kernels and the defaults against transformers on this CPU class, then
# on this machine emulating an AVX2-only CPU (docs/auto-configuration.md).
emulate_avx2="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
python benchmarks/target_kernels.py --out docs/results/target_kernels_avx512_bf16.json
env $emulate_avx2 python benchmarks/target_kernels.py --out docs/results/target_kernels_avx2_emulated.json
python benchmarks/cpu_class.py --out docs/results/cpu_class_avx512_bf16
env $emulate_avx2 python benchmarks/cpu_class.py --out docs/results/cpu_class_avx2_emulated
echo "== $(date -u +%H:%M:%S) done" >&2
