"""A choice that exists before anything is timed: what this library measured for the zoo's default
pair on a CPU class, so that the first start on such a machine decides in milliseconds instead of
timing every candidate (a minute or more on 2 cores, several on a busy machine).

The prior is a measurement, not a guess: the choice's own timings on the machine named in NOTE
(the default pair's candidates, interleaved, on an idle machine), put through the same chooser
(tune.costs.choose) with the decoder's γ_max; the default target without a draft takes the same
target kernel. It covers one class, CPUs with AVX-512 BF16 and no
AMX run with 2 threads (as measured; γ_max up to 8), where every measured machine chose the same
configuration (an AMD EPYC Zen 4, and an Intel
Xeon with AMX kept out: docs/results/native_kernels_zen4.md, vs_llamacpp_spr_noamx.md). Machines
with AMX (oneDNN's tiles change which kernel wins from one machine to the next), AVX2-only CPUs,
other pairs and explicit candidates are timed as before. `specdecode tune` times this machine and
replaces the prior; the guard's costs start from the prior's and follow the loop's own timings.
"""

from __future__ import annotations

import dataclasses

from specdecode import native
from specdecode.config import DecoderConfig
from specdecode.models import zoo
from specdecode.models.kernels import TargetKernel
from specdecode.models.pair import model_names
from specdecode.tune.costs import Choice, DraftCost, TargetCost, choose
from specdecode.tune.hardware import cpu_report

# The default pair on an AMD EPYC Zen 4, 2 cores (the choice's timings, 2026-12-07): the
# batch-invariant bfloat16 target and the int4 draft on specdecode.native.
TARGETS = {TargetKernel.BFLOAT16_INVARIANT.value: TargetCost(0.103, {2: 1.02, 9: 1.31}, 0.0120)}
DRAFTS = {("int4", "native"): DraftCost(0.017, 0.0072)}
NOTE = ("the prior for CPUs with AVX-512 BF16 and no AMX (the default pair measured on an AMD EPYC Zen 4: "
        "bfloat16-invariant target step 103 ms, r(9) 1.31; int4 native draft step 17 ms); not timed here: "
        "`specdecode tune` times this machine")


def prior_choice(config: DecoderConfig, targets: tuple[str, ...], kinds: tuple[str, ...]) -> Choice | None:
    """The prior's Choice for this config, or None where it does not cover it (then time;
    prior_gap says why).

    Args:
        config: the decoder's options (dtype "auto", the zoo's default pair by name, the draft's
            default vocabulary limit).
        targets, kinds: the candidates this config would time (tune.candidates_of): the prior's
            kernels must be among them.
    """
    if prior_gap(config, targets, kinds) is not None:
        return None
    # without a draft: plain decoding (and free drafts) on the same target, whose one-token step was
    # within 10% of llama.cpp's on the same weights and whose verifies are cheaper (no BF16 file made)
    choice = choose(TARGETS, DRAFTS if model_names(config)[1] is not None else {},
                    max_gamma=config.num_speculative_tokens)
    return dataclasses.replace(choice, notes=(NOTE,), prior=True)


def prior_gap(config: DecoderConfig, targets: tuple[str, ...], kinds: tuple[str, ...]) -> str | None:
    """Why the prior does not cover this config on this machine (a phrase for the progress line),
    or None where it does."""
    target, draft = model_names(config)
    if config.dtype != "auto" or target != zoo.DEFAULT_TARGET or draft not in (zoo.DEFAULT_DRAFT, None) \
            or config.draft_vocab_limit != "auto":
        return "it covers the default target, with the default draft or none, and dtype 'auto' only"
    # measured up to γ_max = 8 (r(9)): a larger γ_max prices verifies it has not seen
    if config.num_speculative_tokens > 8:
        return f"it was measured up to γ = 8, not {config.num_speculative_tokens}"
    if TargetKernel.BFLOAT16_INVARIANT.value not in targets or (draft is not None and "int4" not in kinds):
        return "its kernels (the batch-invariant target, the int4 draft) are not candidates here"
    report = cpu_report()
    # the machine as it is: not acting as an older one (emulation variables), 2 threads as measured
    if any(flag.startswith("amx") for flag in report["flags"]):
        return "it covers CPUs without AMX, whose products differ most from one machine to the next"
    if "avx512_bf16" not in report["flags"] or not report["native_bfloat16"]:
        return "it covers CPUs with AVX-512 BF16 only"
    if report["emulated"]:
        return f"this machine acts as another ({', '.join(report['emulated'])} set)"
    if report["threads"] != 2:
        return f"it was measured on 2 threads, not {report['threads']}"
    if not native.available() or native.isa() != "avx512-bf16":
        return "specdecode's kernels are not built for AVX-512 BF16 here"
    return None
