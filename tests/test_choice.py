"""The configuration chooser (specdecode.tune.costs) on the cost tables of several machine classes:
a CPU with native bfloat16, an AVX2-only CPU, an AMX CPU with llama.cpp, and a GPU."""

import pytest

import specdecode.tune.costs as choice_module

from specdecode.engine.cost import expected_tokens
from specdecode.tune.costs import GAMMA_TOLERANCE, Choice, DraftCost, TargetCost, choose

# The default pair on 2 cores of an AVX-512-BF16 CPU (bfloat16 and MKL float32 whole-model
# timings; float32 with packed weights from docs/auto-configuration.md's per-layer ratios).
NATIVE_BF16 = {
    "bfloat16": TargetCost(0.219, {2: 0.95, 5: 0.92, 9: 1.10, 17: 1.5}, 0.004),
    "float32-packed": TargetCost(0.403, {2: 1.1, 5: 1.25, 9: 1.4, 17: 2.0}, 0.012),
}
NATIVE_BF16_DRAFTS = {("int4", "bfloat16"): DraftCost(0.024, 0.002), ("int8", "bfloat16"): DraftCost(0.035, 0.002),
                      ("none", "bfloat16"): DraftCost(0.057, 0.002), ("int4", "float32"): DraftCost(0.060, 0.005),
                      ("none", "float32"): DraftCost(0.157, 0.005)}
# An AVX2-only CPU (no native bfloat16): a bfloat16 product of k rows costs about k/2 one-row
# products (the 1536 → 8960 projection: 8.2, 9.3, 17.6, 32.6 ms for 1, 2, 5, 9 rows), float32
# with packed weights about one row's up to 9 rows, and its one-row step is the faster one.
AVX2 = {
    "bfloat16": TargetCost(0.40, {2: 1.13, 5: 2.15, 9: 3.98, 17: 7.5}, 0.35),
    "float32-packed": TargetCost(0.30, {2: 1.05, 5: 1.2, 9: 1.4, 17: 2.1}, 0.02),
}
AVX2_DRAFTS = {("int4", "bfloat16"): DraftCost(0.05, 0.03), ("none", "bfloat16"): DraftCost(0.13, 0.03),
               ("int4", "float32"): DraftCost(0.06, 0.006), ("none", "float32"): DraftCost(0.10, 0.006)}
# A GPU: a verify of up to 17 tokens costs one step; the draft a fiftieth of one.
GPU = {"bfloat16": TargetCost(0.020, {2: 1.0, 9: 1.0, 17: 1.02}, 0.0001)}
GPU_DRAFTS = {("none", "bfloat16"): DraftCost(0.0004)}


def test_native_bfloat16_class_keeps_bfloat16_and_the_int4_draft_at_full_gamma():
    choice = choose(NATIVE_BF16, NATIVE_BF16_DRAFTS)
    assert (choice.target_kernel, choice.draft_kernel, choice.draft_dtype) == ("bfloat16", "int4", "bfloat16")
    assert choice.gamma >= 6
    assert choice.speedup > 2.5


def test_avx2_class_avoids_multi_row_bfloat16():
    choice = choose(AVX2, AVX2_DRAFTS)
    assert choice.target_kernel == "float32-packed"
    assert choice.draft_kernel == "int4" and choice.gamma >= 4
    assert choice.draft_dtype == "float32"  # its prompt read is the cheaper one here
    assert choice.r < 1.5  # what a bfloat16 verify of that width would cost: several steps
    assert AVX2["bfloat16"].ratio(choice.gamma + 1) > 2.5


def test_a_class_where_only_bfloat16_steps_are_fast_decodes_plainly_rather_than_verify_slowly(monkeypatch):
    # one-row bfloat16 three times faster than float32, but a k-row bfloat16 call costs k rows:
    # no draft pays for a verify that costs as much as the tokens it saves
    table = {"bfloat16": TargetCost(0.10, {2: 2.0, 5: 5.0, 9: 9.0}, 0.1),
             "float32-packed": TargetCost(0.30, {2: 1.05, 5: 1.2, 9: 1.4}, 0.02)}
    drafts = {("int4", "float32"): DraftCost(0.02)}
    choice = choose(table, drafts, alpha=0.7, prompt_tokens=0)
    assert choice.draft_kernel is None and choice.gamma == 0 and choice.target_kernel == "bfloat16"
    assert choice.speedup == 1.0
    # drafts right often enough would make float32 speculation faster, but where they are right
    # less often float32's slow steps lose to bfloat16's plain ones: weighed as much, not taken
    assert choose(table, drafts, alpha=0.95, prompt_tokens=0).target_kernel == "bfloat16"
    assert choose(table, drafts, alpha=0.95, low_alpha=0.95, prompt_tokens=0).target_kernel == "float32-packed"


def test_without_amx_llama_cpps_faster_step_wins_with_a_draft():
    # the default pair on a Zen 4 CPU (AVX-512-BF16, no AMX), 2 cores: torch's bfloat16 step 197 ms
    # (its matrix-vector kernels), llama.cpp's BF16 GGUF 102 ms with r(k) from llama-cpp-python
    # 0.3.36; the int4 draft 24 ms, the draft's Q4_K_M file on llama.cpp 23 ms
    table = {"bfloat16-gemv": TargetCost(0.197, {2: 0.85, 5: 0.92, 9: 1.10, 17: 1.5, 64: 2.3}, 0.010),
             "llama.cpp-bf16": TargetCost(0.102, {2: 1.34, 4: 1.47, 5: 1.56, 8: 1.83, 9: 1.96, 16: 2.54},
                                          0.0116)}
    drafts = {("int4", "bfloat16"): DraftCost(0.024, 0.002), ("gguf", "llama.cpp"): DraftCost(0.023, 0.0061)}
    choice = choose(table, drafts)
    assert choice.target_kernel == "llama.cpp-bf16" and choice.draft_kernel is not None
    assert choice.gamma >= 2 and choice.speedup > 1.25


def test_avx2_class_with_llama_cpp_takes_its_bf16_target_with_the_int4_draft():
    # the default pair where llama.cpp is built AVX2-only and torch runs at AVX2 (emulated on the
    # AMX Xeon, 2 cores; docs/llamacpp.md): steps, r(9) and prompt reads as dtype="auto" measured
    # them. llama.cpp's BF16 step is the fastest and its verify the cheapest; bfloat16 on torch
    # costs r(9) = 4-4.6 there (no native bfloat16), float32 with packed weights a slower step
    table = {"bfloat16": TargetCost(0.298, {9: 3.99}, 0.1232), "bfloat16-gemv": TargetCost(0.258, {9: 4.62}, 0.1232),
             "llama.cpp-bf16": TargetCost(0.232, {9: 1.76}, 0.0334),
             "float32-packed": TargetCost(0.369, {9: 1.82}, 0.0372)}
    drafts = {("int4", "bfloat16"): DraftCost(0.035, 0.0144), ("int4", "bfloat16-gemv"): DraftCost(0.035, 0.0144),
              ("int4", "float32"): DraftCost(0.464, 0.0268), ("int8", "bfloat16"): DraftCost(0.062, 0.0428),
              ("int8", "float32"): DraftCost(0.285, 0.0108), ("none", "bfloat16"): DraftCost(0.088, 0.0378),
              ("gguf", "llama.cpp"): DraftCost(0.043, 0.0158)}
    choice = choose(table, drafts)
    assert (choice.target_kernel, choice.draft_kernel) == ("llama.cpp-bf16", "int4")
    assert 3 <= choice.gamma <= 8 and choice.speedup > 1.3
    # without llama.cpp, torch's float32 with packed weights: bfloat16's wide calls cost too much
    torch_only = {k: v for k, v in table.items() if not k.startswith("llama.cpp")}
    assert choose(torch_only, drafts).target_kernel == "float32-packed"


def test_speculation_must_beat_plain_decoding_by_the_margin(monkeypatch):
    # the llama.cpp Q4_K_M target here: a k-token call costs 1.5-3.3 steps. With the int4 draft
    # (a third of a step) Eq. 1 rated it 1.07x plain at α = 0.85, and it ran 0.96x: plain decoding
    table = {"llama.cpp-gguf": TargetCost(0.085, {2: 1.5, 5: 1.82, 9: 3.3}, 0.008)}
    assert choose(table, {("int4", "bfloat16-gemv"): DraftCost(0.026, 0.0076)}).draft_kernel is None
    # a draft a seventh of a step: worth it, unless the margin asks more than it gives
    cheap = {("int4", "bfloat16-gemv"): DraftCost(0.012, 0.0076)}
    monkeypatch.setattr(choice_module, "MARGIN", 0.0)
    assert choose(table, cheap).draft_kernel == "int4"
    monkeypatch.setattr(choice_module, "MARGIN", 0.5)
    assert choose(table, cheap).draft_kernel is None


def test_a_cheap_verify_beats_a_faster_step_where_prompts_are_read_too():
    # the default pair on an AMX CPU (2026-12-06): torch bfloat16 steps in 226 ms but verifies 9
    # tokens for 0.91 of a step and reads a prompt at 5 ms a token; llama.cpp's BF16 steps in 168
    # ms, verifies at 1.86 and reads at 22 ms. Side by side torch ran 11.4 against 9.1 tokens/s
    # (HumanEval) and 6.7 against 5.7 (Spec-Bench) with the int4 draft (docs/results/vs_llamacpp_plain_floor.md)
    table = {"bfloat16": TargetCost(0.226, {2: 0.95, 5: 0.93, 9: 0.91, 17: 1.2, 64: 1.42}, 0.005),
             "llama.cpp-bf16": TargetCost(0.168, {2: 1.06, 5: 1.39, 9: 1.86, 17: 2.9, 64: 8.4}, 0.022)}
    drafts = {("int4", "bfloat16-gemv"): DraftCost(0.026, 0.0076)}
    assert choose(table, drafts).target_kernel == "bfloat16"
    assert choose(table, {}).target_kernel == "llama.cpp-bf16"  # plain decoding: the faster step


def test_a_slow_prompt_read_weighs_against_a_kernel_with_fast_steps():
    # bfloat16 without native support: the fastest one-row steps, but an 82 ms/token prompt read
    table = {"bfloat16": TargetCost(0.146, {2: 1.5, 5: 3.1, 9: 5.7}, 0.082),
             "float32-packed": TargetCost(0.300, {2: 1.1, 5: 1.3, 9: 1.5}, 0.022)}
    drafts = {("int4", "bfloat16"): DraftCost(0.05)}
    assert choose(table, drafts, prompt_tokens=0).target_kernel == "bfloat16"
    long_prompt = choose(table, drafts, prompt_tokens=2000)
    assert long_prompt.target_kernel == "float32-packed"
    plain_bf16 = 128 / (2000 * 0.082 + 128 * 0.146)  # tokens/s of the request, prompt read included
    assert long_prompt.rate > plain_bf16 and long_prompt.plain_rate >= plain_bf16


def test_gpu_class_drafts_the_most_tokens():
    choice = choose(GPU, GPU_DRAFTS, alpha=0.8, max_gamma=12)
    assert choice.gamma == 12 and choice.draft_kernel == "none"


def test_the_choice_is_the_best_kernel_pair_by_eq1_with_the_largest_gamma_near_its_best():
    rates = {(kernel, draft, gamma): expected_tokens(0.75, gamma) / (cost.step_s * cost.ratio(gamma + 1)
                                                                      + gamma * draft_cost.step_s)
             for kernel, cost in AVX2.items() for draft, draft_cost in AVX2_DRAFTS.items()
             for gamma in range(1, 9)}
    choice = choose(AVX2, AVX2_DRAFTS, alpha=0.75, prompt_tokens=0)  # decoding alone: Eq. 1's rates
    kernel, draft, _ = max(rates, key=rates.get)
    assert (choice.target_kernel, (choice.draft_kernel, choice.draft_dtype)) == (kernel, draft)
    near = [g for (k, d, g), rate in rates.items()
            if (k, d) == (kernel, draft) and rate >= (1 - GAMMA_TOLERANCE) * max(rates.values())]
    assert choice.gamma == max(near) and choice.rate == pytest.approx(rates[kernel, draft, choice.gamma])
    assert choice.rate >= choice.plain_rate


def test_any_draft_goes_with_any_target_kernel():
    # a float32 target with a bfloat16 draft: the draft's dtype is chosen for its own speed
    table = {"float32-packed": TargetCost(0.30, {2: 1.05, 9: 1.4}, 0.02)}
    drafts = {("int4", "float32"): DraftCost(0.30), ("int4", "bfloat16-gemv"): DraftCost(0.03)}
    choice = choose(table, drafts)
    assert (choice.target_kernel, choice.draft_dtype) == ("float32-packed", "bfloat16-gemv")


def test_no_draft_costs_means_plain_decoding_with_the_fastest_kernel():
    choice = choose(AVX2, {})
    assert isinstance(choice, Choice) and choice.draft_kernel is None and choice.target_kernel == "float32-packed"
    # no draft model was given (--draft none): the line does not say that none pays
    assert "the fastest target kernel here" in choice.describe() and "pays" not in choice.describe()
    assert "no draft model pays" in choose(AVX2, {("none", "bfloat16"): DraftCost(0.29, 0.03)}).describe()


def test_plain_decoding_keeps_its_kernels_verify_costs_for_the_guard_of_free_drafts():
    """A plain choice still prices free drafts' verifies from its own timings (no second
    measurement at load): c = 0, the line through the chosen kernel's r(2) and r(γ_max + 1)."""
    from specdecode.tune.timing import verify_line

    choice = choose(AVX2, {}, max_gamma=4)
    cost = AVX2[choice.target_kernel]
    assert choice.r2 == cost.ratio(2) and choice.r == cost.ratio(5)
    assert choice.guard_costs(4) == (0.0, *verify_line(cost.ratio(2), cost.ratio(5), 4))
    # a choice cached before r(2) was kept says nothing: the facade times the guard's costs
    assert Choice("bfloat16", None, None, 0, 1.0, 1.0).guard_costs(4) is None


def test_ratio_interpolates_and_extrapolates():
    cost = TargetCost(1.0, {3: 2.0, 5: 4.0}, 0.0)
    assert cost.ratio(1) == 1.0 and cost.ratio(2) == 1.5 and cost.ratio(4) == 3.0 and cost.ratio(7) == 6.0


@pytest.mark.parametrize("kwargs", [dict(targets={}), dict(alpha=1.0), dict(alpha=-0.1), dict(max_gamma=0),
                                    dict(prompt_tokens=-1), dict(new_tokens=0)])
def test_bad_arguments_raise(kwargs):
    args = dict(targets=AVX2, drafts=AVX2_DRAFTS) | kwargs
    with pytest.raises(ValueError):
        choose(**args)


def test_an_invariant_target_within_five_percent_is_preferred_without_changing_whether_drafts_run():
    from specdecode.tune.costs import DraftCost, TargetCost, choose

    drafts = {("int4", "bfloat16"): DraftCost(0.02, 0.005)}
    fast = TargetCost(0.100, {2: 1.1, 9: 1.2}, 0.01)
    near = TargetCost(0.102, {2: 1.1, 9: 1.2}, 0.01)   # within 5%: taken
    far = TargetCost(0.130, {2: 1.1, 9: 1.2}, 0.01)    # not
    assert choose({"bfloat16": fast, "bfloat16-invariant": near}, drafts).target_kernel == "bfloat16-invariant"
    assert choose({"bfloat16": fast, "bfloat16-invariant": far}, drafts).target_kernel == "bfloat16"
    # where speculation wins narrowly (a dear draft), a plain invariant configuration scoring within
    # 5% of it is not taken over it: the preference never turns speculation off
    dear = {("int4", "bfloat16"): DraftCost(0.039, 0.005)}
    assert choose({"bfloat16": fast}, dear).draft_kernel == "int4"
    spec = choose({"bfloat16": fast, "bfloat16-invariant": TargetCost(0.101, {2: 5.0, 9: 9.0}, 0.01)}, dear)
    assert spec.draft_kernel == "int4" and spec.target_kernel == "bfloat16"
