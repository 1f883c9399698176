"""The tuning layer: from a DecoderConfig and this machine to what gets loaded.

`plan(config)` resolves the config's "auto" values. With dtype="auto" (or "gguf") on the CPU it
times this pair's candidate kernels once per machine (specdecode.tune.candidates, cached by
specdecode.tune.cache) and picks the fastest by paper Eq. 1 with the measured verify cost
(specdecode.tune.costs); the facade then loads what the plan says (specdecode.models.pair) and
times the guard's starting costs (specdecode.tune.timing.guard_costs). It sits above models/:
models load and check, this layer measures and chooses.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from specdecode import native
from specdecode.config import DEFAULT_DRAFT_QUANTIZATION, LLAMA_MAX_ROWS, QUANTIZATION_BITS, DecoderConfig
from specdecode.models import kquant, llamacpp, packed, zoo
from specdecode.models.gguf_convert import converted_gguf
from specdecode.models.loading import gguf_source, is_gguf, load_model, parse_device
from specdecode.models.kernels import TargetKernel
from specdecode.models.pair import LLAMA_WEIGHTS, LoadPlan, backend, draft_vocab_limit, model_names
from specdecode.models.quant_cache import prepare_draft_cached
from specdecode.tune import cache
from specdecode.tune.candidates import Loaders, measure_and_choose
from specdecode.tune.costs import Choice
from specdecode.engine.threads import requested_threads
from specdecode.tune.hardware import CpuWatch, cpu_report, idle_now, native_bfloat16
from specdecode.tune.prior import prior_choice, prior_gap
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


def plan(config: DecoderConfig, progress: Callable[[str], None] | None = None, measure_now: bool = False) -> Plan:
    """The Plan for a validated config on this machine (measuring once per machine and pair where
    dtype="auto" or "gguf" asks for it on the CPU and no prior covers it (tune.prior); later starts
    read the choice cache). measure_now: time the candidates whatever is cached or known
    (`specdecode tune`).

    Raises:
        ValueError, FileNotFoundError, ImportError: a model that cannot be loaded while measuring,
            or the llama.cpp backend asked for without llama-cpp-python.
    """
    target, draft = model_names(config)
    if torch.get_num_threads() != requested_threads():  # another decoder's governor lowered it for a while:
        torch.set_num_threads(requested_threads())      # plan, and time, for the count asked for
    device = parse_device(config.device, target)
    llama = llamacpp.available()
    own_gguf = config.dtype == "gguf" and config.batch_invariant is True  # the file's blocks on our kernels only
    # dtype="gguf" runs without llama.cpp where specdecode's kernels cover the file
    needs_llama = config.backend == "llama.cpp" or (config.dtype == "gguf" and not own_gguf
                                                    and not (has_gguf(target) and _kquant_candidate(config)))
    if (needs_llama or config.quantize_draft == "gguf") and not llama:
        llamacpp.library()  # raises the ImportError that says what to install
    for spec, needed in ((target, config.uses_llama_cpp), (draft, config.quantize_draft == "gguf")):
        if needed and not has_gguf(spec):
            raise ValueError(f"{spec!r} is not a GGUF file or a zoo name: the llama.cpp backend runs GGUF files "
                             "(pass backend='torch' and a torch dtype for a transformers directory)")
    quantization = _quantization(config)
    kernel = TargetKernel.of(config.dtype, config.backend)
    if kernel is TargetKernel.BFLOAT16 and config.dtype == "bfloat16" and _invariant_candidate(config, device):
        kernel = TargetKernel.BFLOAT16_INVARIANT
    if own_gguf:
        native.load()  # raises NativeUnavailable, which says what to install
        reason = kquant.unsupported(gguf_source(target, progress))
        if reason is not None:
            raise ValueError(f"batch_invariant=True with dtype='gguf' runs the file's own blocks on specdecode's "
                             f"kernels, which cannot run this one: {reason} (pass batch_invariant='auto' for llama.cpp)")
        kernel = TargetKernel.GGUF_INVARIANT
    draft_kernel = "llama.cpp" if quantization == "gguf" else _name(kernel.dtype) if kernel.dtype else "bfloat16"
    static = Plan(LoadPlan(kernel, None if draft is None else quantization, draft_kernel, max_rows=_rows(config)),
                  config.num_speculative_tokens, config.free_drafts_rule)
    if config.dtype not in ("auto", "gguf") or device.type != "cpu" or config.device_map is not None \
            or not isinstance(target, str):
        return static
    targets, kinds = candidates_of(config, quantization)
    key = _key(config, targets + kinds)
    cached = None if measure_now else cache.load_choice(key)
    choice = cached or (None if measure_now else prior_choice(config, targets, kinds))
    if choice is None and not measure_now and progress:
        progress(f"no measured prior for this machine ({prior_gap(config, targets, kinds)}): timing the candidates")
    if choice is not None and choice.provisional and idle_now():
        if progress:
            progress("the cached choice was timed beside other work and the machine is idle now: timing again")
        choice = None
    if choice is None:
        with CpuWatch() as watch:
            choice = measure_and_choose(_loaders(config, target, draft, progress), targets, kinds,
                                        config.num_speculative_tokens, progress,
                                        busy=watch.busy_so_far)
        if choice is None:  # not worth timing: bfloat16 as given
            return static
        if watch.busy:  # timings taken beside other work mislead: kept, and refined on an idle start
            note = (f"measured while other processes kept {watch.others_cores:.1f} cores busy: provisional (cached; "
                    "timed again at the first start on an idle machine, or by `specdecode tune`)")
            choice = dataclasses.replace(choice, notes=choice.notes + (note,), provisional=True)
            if progress:
                progress(note)
        cache.save_choice(key, choice)  # (a prior is not: it costs nothing to find again)
    if progress:
        machine = cpu_report()
        source = "cached, " if choice is cached else ""
        threads = f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"
        progress(f"chose for this machine ({source}{machine['cpu']}, {machine['capability']}, {threads}): "
                 f"{choice.headline()}")
    upcast = not native_bfloat16()
    if choice.draft_kernel is None:
        # no draft model pays here; free drafts (suffix drafts by default, guarded) cost none and
        # stay: an input-grounded request copies long runs (code edits: 1.82x the llama.cpp Q4_K_M
        # target's plain decoding, docs/results/vs_llamacpp_gguf.md)
        return Plan(LoadPlan(TargetKernel(choice.target_kernel), None, upcast_wide_reads=upcast,
                             max_rows=_rows(config)), config.num_speculative_tokens, config.free_drafts_rule, choice)
    return Plan(LoadPlan(TargetKernel(choice.target_kernel), choice.draft_kernel, choice.draft_dtype,
                         upcast_wide_reads=upcast, max_rows=_rows(config)), choice.gamma, config.free_drafts_rule,
                choice)


def _invariant_candidate(config: DecoderConfig, device) -> bool:
    """Whether the batch-invariant kernels may run the target: asked for or left to "auto", a
    torch target on the CPU, and kernels that build here with vector instructions
    (specdecode.native; the model's kind is checked once it is loaded)."""
    if config.batch_invariant is False or config.uses_llama_cpp or config.backend == "llama.cpp" \
            or device.type != "cpu" or config.device_map is not None:
        return False
    if config.batch_invariant is True:
        native.load()  # raises NativeUnavailable, which says what to install
        return True
    # the portable build (no AVX2) is correct but several times slower than torch: asked for only
    return native.available() and native.isa() != "portable"


def _kquant_candidate(config: DecoderConfig) -> bool:
    """Whether dtype="gguf" may run the file's own blocks on specdecode's kernels: batch_invariant
    not False, kernels here (vector ones unless batch_invariant=True asks for them whatever their
    speed), and a file models.kquant covers (Qwen2, Q4_K/Q6_K)."""
    target, _ = model_names(config)
    if config.batch_invariant is False or not has_gguf(target) or not native.available() \
            or (native.isa() == "portable" and config.batch_invariant is not True):
        return False
    return kquant.unsupported(gguf_source(target)) is None


def _quantization(config: DecoderConfig) -> str:
    """quantize_draft with "auto" resolved for a plan without measuring: on the CPU, a llama.cpp
    target's draft on llama.cpp too where it has a GGUF file, else int4; "none" elsewhere."""
    if config.quantize_draft != "auto":
        return config.quantize_draft
    _, draft = model_names(config)
    if not isinstance(draft, str) or parse_device(config.device).type != "cpu":
        return "none"
    return "gguf" if config.uses_llama_cpp and has_gguf(draft) else DEFAULT_DRAFT_QUANTIZATION


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(config: DecoderConfig) -> int:
    """The rows a llama.cpp model is built for: the batch's limit (16 where there is none)."""
    return config.max_batch_size or 16


def has_gguf(spec) -> bool:
    """Whether a model spec has a GGUF file llama.cpp can run (a zoo name or a .gguf path)."""
    return isinstance(spec, str) and (spec in zoo.ZOO or is_gguf(spec))


def candidates_of(config: DecoderConfig, quantization: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(target kernels, draft kinds) that dtype="auto" (or "gguf") times for this config;
    quantization: quantize_draft with "auto" resolved as plan() resolves it."""
    target, draft = model_names(config)
    # llama.cpp holds at most LLAMA_MAX_ROWS rows
    llama = llamacpp.available() and (config.max_batch_size or 0) <= LLAMA_MAX_ROWS
    if config.dtype == "gguf":
        own = (TargetKernel.GGUF_INVARIANT.value,) if _kquant_candidate(config) else ()
        targets = own if config.batch_invariant is True else \
            ((TargetKernel.LLAMA_GGUF.value,) if llama else ()) + own
    else:
        # the float32 target reads twice the bytes: where bfloat16 products are native it cannot win,
        # and timing it would hold a float32 copy (twice the memory) for nothing
        torch_kernels = (("bfloat16",) + (() if native_bfloat16() else ("float32-packed",))) \
            if config.backend != "llama.cpp" else ()
        if _invariant_candidate(config, parse_device(config.device)):
            torch_kernels = (TargetKernel.BFLOAT16_INVARIANT.value,) if config.batch_invariant is True \
                else torch_kernels + (TargetKernel.BFLOAT16_INVARIANT.value,)
        # token trees need a custom attention mask, which llama.cpp's API lacks
        llama_kernels = (TargetKernel.LLAMA_BF16.value,) if llama and has_gguf(target) and config.tree_width == 1 \
            and config.backend != "torch" else ()
        targets = torch_kernels + (llama_kernels if config.batch_invariant is not True else ())
    # drafter-invariant verification asks for seeded tokens that depend neither on the drafts nor
    # on what runs beside a request, which only a batch-invariant target keeps (also without a draft)
    invariant = tuple(t for t in targets if TargetKernel(t).batch_invariant)
    if config.verification == "drafter-invariant" and invariant:
        targets = invariant
    kinds = () if draft is None else (quantization,) if config.quantize_draft != "auto" \
        or not isinstance(draft, str) else ("int4", "int8", "none") + (("gguf",) if llama and has_gguf(draft) else ())
    return targets, kinds


def choice_key(config: DecoderConfig) -> str:
    """The choice cache's key for this config on this machine (specdecode.tune.cache)."""
    targets, kinds = candidates_of(config, _quantization(config))
    return _key(config, targets + kinds)


def _key(config: DecoderConfig, candidates: tuple[str, ...]) -> str:
    target, draft = model_names(config)
    return cache.cache_key(str(target), None if draft is None else str(draft), config.num_speculative_tokens,
                           candidates)


def _loaders(config: DecoderConfig, target: str, draft, progress=None) -> Loaders:
    """The candidates of this pair, each loaded on demand from names, paths or the draft object."""
    vocab_limit = draft_vocab_limit(config)

    def load_target(dtype):
        # float32 as the bfloat16 weights upcast: timing depends on the kernels, not the weights'
        # last bits, and a zoo model then needs no float32 weight cache to be timed
        model = load_model(target, torch.bfloat16, progress)[0]
        if getattr(model.config, "is_encoder_decoder", False):
            return None
        return float32(model) if dtype == torch.float32 else model

    def load_draft(kind, dtype):
        if dtype == torch.float32:  # the bfloat16 one upcast: its integers are the same
            return float32(load_draft(kind, torch.bfloat16))
        model = copy.deepcopy(draft) if isinstance(draft, torch.nn.Module) else load_model(draft, dtype, progress)[0]
        if kind in QUANTIZATION_BITS:
            prepare_draft_cached(model, QUANTIZATION_BITS[kind], draft if isinstance(draft, str) else None, progress)
        return model

    def file_target(kernel):
        source = gguf_source(target)
        if kernel == TargetKernel.GGUF_INVARIANT:
            return kquant.kquant_model(source)
        weights = LLAMA_WEIGHTS[TargetKernel(kernel)]
        return llamacpp.LlamaCppLM(source if weights is None else converted_gguf(source, weights, progress), max_rows=1)

    return Loaders(target=load_target, draft=load_draft,
                   backend=lambda model, is_draft: backend(model, vocab_limit if is_draft else None, lean=is_draft),
                   pack=packed.pack_linears if packed.available() else None, file_target=file_target,
                   llama_draft=lambda: llamacpp.LlamaCppLM(gguf_source(draft), max_rows=1))


def float32(model):
    """The model's float weights in float32, in place (torch's own Module.float: transformers
    refuses .float() on a model it loaded from GGUF, a zoo model's first start, though its
    weights are floats; integer layers keep their integers)."""
    return torch.nn.Module.float(model)
