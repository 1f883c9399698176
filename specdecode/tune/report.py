"""From a Plan and the loaded Pair: the guard's starting costs, and the report of what runs and why
(SpeculativeDecoder.configuration)."""

from __future__ import annotations

from typing import Callable

from specdecode.config import DecoderConfig
from specdecode.proposers import CrossVocabProposer, find_proposer
from specdecode.tune.hardware import cpu_report
from specdecode.tune.timing import guard_costs


def starting_guard_costs(config: DecoderConfig, plan, pair, progress: Callable[[str], None] | None = None
                         ) -> tuple[float, ...] | None:
    """(c, slope[, base]) the guard starts from (engine.guard), or None for no guard: given
    (config.guard_costs), else from the choice's own timings, else timed now (a few forwards).
    Free drafts alone are guarded too: they cost no forward, but each verified draft costs its share
    of a wider target call (a Q4_K_M target on llama.cpp: r(5) = 1.8)."""
    if not config.guard or (pair.draft is None and not plan.free_drafts):
        return None
    if config.guard_costs is not None:
        return tuple(config.guard_costs)
    if plan.choice is not None and (costs := plan.choice.guard_costs(plan.gamma)) is not None:
        return costs
    if progress:
        progress("measuring c (draft step / target step) and the verify costs r(2), r(γ+1) for the guard (a few "
                 "forwards; --no-guard skips it)")
    return guard_costs(pair.target.backend, pair.draft.backend if pair.draft is not None else None, plan.gamma,
                       pair.is_encoder_decoder)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "gguf"


def configuration(config: DecoderConfig, plan, pair, proposer) -> dict:
    """What runs, for reports (`generate --json`, the server's /v1/models, `bench`): {"dtype": the
    target's numbers ("bfloat16", "float32", ...; "gguf": its file's own quantization), "backend":
    "torch" or "llama.cpp", "target_kernel" (specdecode.models.kernels.TargetKernel),
    "target_weights" and "draft_weights" (what each model's numbers are, e.g. "qwen2 1.5B BF16
    GGUF", "bfloat16, int4 layers"), "draft_dtype" (the draft's: any dtype keeps the output exact),
    "num_speculative_tokens": γ_max (0 without drafts), "free_drafts", "batch_invariant": whether
    each token's logits are the same bits alone, in a verify or beside other rows
    (DecoderConfig.batch_invariant), "machine": this CPU (tune.hardware.cpu_report), "choice": why
    dtype="auto" chose it (None when the dtype was given, the target was a model object, or it was
    too small to time), "draft_vocabulary": the shared vocabulary of a draft of another family, or
    None}. config: the decoder's options.  proposer: the engine's (where a draft of another vocabulary says how much it shares)."""
    choice, kernel, drafting = plan.choice, plan.load.target_kernel, pair.draft is not None
    cross = find_proposer(proposer, CrossVocabProposer) if proposer is not None else None
    return {"dtype": _dtype_name(pair.dtype), "backend": kernel.backend, "target_kernel": kernel.value,
            "target_weights": pair.target.weights, "draft_weights": pair.draft.weights if drafting else None,
            "draft_dtype": _dtype_name(pair.draft_dtype) if drafting else None,
            "num_speculative_tokens": plan.gamma if drafting or plan.free_drafts else 0,
            "free_drafts": plan.free_drafts,
            "batch_invariant": bool(getattr(pair.target.backend, "batch_invariant", False)),
            "machine": cpu_report(),
            "choice": None if choice is None else {"summary": choice.describe(), "measured": list(choice.notes),
                                                   "prior": choice.prior},
            "draft_vocabulary": None if cross is None else {
                "shared_tokens": cross.num_shared,
                "method": {"auto": "TLI for sampled requests, SLEM for greedy ones", "tli": "TLI",
                           "slem": "SLEM"}[config.cross_vocab]}}
