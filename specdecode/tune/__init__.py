"""The tuning layer: from a DecoderConfig and this machine to what gets loaded.

`plan(config)` resolves the config's "auto" values. With dtype="auto" on the CPU it times this
pair's candidate kernels once per machine (specdecode.tune.candidates, cached by
specdecode.tune.cache) and picks the fastest by paper Eq. 1 with the measured verify cost
(specdecode.tune.costs); the facade then loads what the plan says (specdecode.models.pair) and
times the guard's starting costs (specdecode.tune.timing.guard_costs). It sits above models/:
models load and check, this layer measures and chooses.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from specdecode.config import DEFAULT_DRAFT_QUANTIZATION, QUANTIZATION_BITS, DecoderConfig
from specdecode.measure.hardware import cpu_report, describe, native_bfloat16  # moves to tune.hardware
from specdecode.models import packed
from specdecode.models.loading import load_model, parse_device
from specdecode.models.pair import LoadPlan, TargetKernel, backend, draft_vocab_limit, model_names
from specdecode.models.quant_cache import prepare_draft_cached
from specdecode.tune import cache
from specdecode.tune.candidates import Loaders, measure_and_choose
from specdecode.tune.costs import Choice
from specdecode.tune.timing import guard_costs

__all__ = ["Plan", "plan", "guard_costs"]


@dataclass(frozen=True)
class Plan:
    """What the facade builds.

    load: what to load (specdecode.models.pair.LoadPlan).  gamma: γ_max.
    free_drafts: "suffix", "ngram" or None.  choice: what dtype="auto" measured and chose, or
    None (a dtype given, a model object, another device, a target too small to time).
    """

    load: LoadPlan
    gamma: int
    free_drafts: str | None
    choice: Choice | None = None


def plan(config: DecoderConfig, progress: Callable[[str], None] | None = None) -> Plan:
    """The Plan for a validated config on this machine (measuring once per machine and pair where
    dtype="auto" asks for it; later starts read the choice cache).

    Raises:
        ValueError, FileNotFoundError: a model that cannot be loaded while measuring.
    """
    target, draft = model_names(config)
    device = parse_device(config.device, target)
    quantization = config.quantize_draft
    if quantization == "auto":  # int4 for a decoder-only draft we load on the CPU
        quantization = DEFAULT_DRAFT_QUANTIZATION if isinstance(draft, str) and device.type == "cpu" else "none"
    static = Plan(LoadPlan(TargetKernel.BFLOAT16 if config.dtype == "auto" else TargetKernel.of_dtype(config.dtype),
                           None if draft is None else quantization,
                           "bfloat16" if config.dtype == "auto" else config.dtype),
                  config.num_speculative_tokens, config.free_drafts_rule)
    if config.dtype != "auto" or device.type != "cpu" or config.device_map is not None or not isinstance(target, str):
        return static
    # every draft kernel the default allows; the one asked for, or a model object's own, alone
    kinds = () if draft is None else ("int4", "int8", "none") \
        if config.quantize_draft == "auto" and isinstance(draft, str) else (quantization,)
    key = cache.cache_key(str(target), None if draft is None else str(draft), config.num_speculative_tokens, kinds)
    choice = cache.load_choice(key)
    if choice is None:
        choice = measure_and_choose(_loaders(config, target, draft), kinds, config.num_speculative_tokens, progress)
        if choice is None:  # not worth timing: bfloat16 as given
            return static
        cache.save_choice(key, choice)
    if progress:
        progress(f"chose for this machine ({describe(cpu_report())}): {choice.describe()}")
    if choice.draft_kernel is None:
        # plain decoding measured fastest: no draft, and free drafts only where asked for (their
        # drafts cost a multi-token verify too)
        free = config.free_drafts_rule if config.free_drafts != "auto" else None
        return Plan(LoadPlan(TargetKernel(choice.target_kernel), None, upcast_wide_reads=not native_bfloat16()),
                    config.num_speculative_tokens, free, choice)
    return Plan(LoadPlan(TargetKernel(choice.target_kernel), choice.draft_kernel, choice.draft_dtype,
                         upcast_wide_reads=not native_bfloat16()), choice.gamma, config.free_drafts_rule, choice)


def _loaders(config: DecoderConfig, target: str, draft) -> Loaders:
    """The candidates of this pair, each loaded on demand from names, paths or the draft object."""
    vocab_limit = draft_vocab_limit(config)

    def load_target(dtype):
        # float32 as the bfloat16 weights upcast: timing depends on the kernels, not the weights'
        # last bits, and a zoo model then needs no float32 weight cache to be timed
        model = load_model(target, torch.bfloat16)[0]
        if getattr(model.config, "is_encoder_decoder", False):
            return None
        return float32(model) if dtype == torch.float32 else model

    def load_draft(kind, dtype):
        if dtype == torch.float32:  # the bfloat16 one upcast: its integers are the same
            return float32(load_draft(kind, torch.bfloat16))
        model = copy.deepcopy(draft) if isinstance(draft, torch.nn.Module) else load_model(draft, dtype)[0]
        if kind in QUANTIZATION_BITS:
            prepare_draft_cached(model, QUANTIZATION_BITS[kind], draft if isinstance(draft, str) else None)
        return model

    return Loaders(target=load_target, draft=load_draft,
                   backend=lambda model, is_draft: backend(model, vocab_limit if is_draft else None, lean=is_draft),
                   pack=packed.pack_linears if packed.available() else None)


def float32(model):
    """The model's float weights in float32, in place (torch's own Module.float: transformers
    refuses .float() on a model it loaded from GGUF, a zoo model's first start, though its
    weights are floats; integer layers keep their integers)."""
    return torch.nn.Module.float(model)
