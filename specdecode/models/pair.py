"""A target and a draft, loaded as a LoadPlan says and checked, ready for the engine.

Each is loaded by name, path, hub id or as a model object, in the plan's dtype, on a device (or
spread by a device_map); the draft's weights int8/int4 where the plan says so (paper §3.6: only
the proposal changes, so exactness holds); the target's kernel applied (packed float32 weights,
one-row calls without oneDNN). This module loads and checks; what to load is decided above it
(specdecode.tune), from the DecoderConfig and, with dtype="auto", this machine's timings.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.config import QUANTIZATION_BITS, DecoderConfig
from specdecode.models import packed, zoo
from specdecode.models.hf import HFCausalLM
from specdecode.models.kernels import TargetKernel
from specdecode.models.invariant import usable as invariant_usable
from specdecode.models.lean import supports as lean_supports
from specdecode.models.llamacpp import LlamaCppLM
from specdecode.models.loading import check_model_spec, eos_token_ids, gguf_source, load_model, parse_device
from specdecode.models.quant_cache import prepare_draft_cached
from specdecode.models.seq2seq import Seq2SeqLM


# a draft's dtype kernels: "bfloat16-gemv" runs its one-row steps without oneDNN, "bfloat16-sdpa"
# its steps' attention with SDPA instead of eager, "native" its whole forward on specdecode.native
# (models/invariant.py; int4 or bfloat16 layers); "llama.cpp" runs its GGUF file as it is
# (quantization "gguf")
DRAFT_KERNEL_DTYPES = {"bfloat16": torch.bfloat16, "bfloat16-gemv": torch.bfloat16, "bfloat16-sdpa": torch.bfloat16,
                       "native": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
                       "float64": torch.float64, "llama.cpp": None}
# the GGUF weight type llama.cpp converts a target's file to for each kernel (None: as it is)
LLAMA_WEIGHTS = {TargetKernel.LLAMA_BF16: "bf16", TargetKernel.LLAMA_F32: "f32", TargetKernel.LLAMA_GGUF: None}


@dataclass(frozen=True)
class LoadPlan:
    """What to load (made by specdecode.tune.plan from a DecoderConfig).

    target_kernel: the target's TargetKernel.
    draft_quantization: "int4" | "int8" | "none": the draft's linear layers (torch); "gguf": its
        GGUF file as it is, on llama.cpp; None loads no draft model (plain decoding, or free
        drafts alone).
    draft_kernel: a DRAFT_KERNEL_DTYPES key: the draft's dtype and its one-row kernels.
    max_rows: the rows a llama.cpp model holds (its sequences; the engine queues requests beyond).
    upcast_wide_reads: bfloat16 products of many rows (prompt reads) run as float32 products of
        the same values: for CPUs without native bfloat16 (models/packed.py).
    """

    target_kernel: TargetKernel
    draft_quantization: str | None
    draft_kernel: str = "bfloat16"
    upcast_wide_reads: bool = False
    max_rows: int = 16


@dataclass(frozen=True)
class Loaded:
    backend: HFCausalLM | Seq2SeqLM | LlamaCppLM
    tokenizer: object
    name: str
    weights: str = ""  # what the numbers are, for reports ("Q4_K_M GGUF", "bfloat16", ...)


def same_tokenizer(target_tokenizer, draft_tokenizer) -> bool:
    """Whether the two tokenizers map every string to the same id (docs/exactness.md rule 6); if not, the
    draft proposes through the shared vocabulary (specdecode.proposers.cross_vocab)."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def model_names(config: DecoderConfig) -> tuple:
    """(target, draft) with "default" resolved to the zoo pair's names (model objects as given)."""
    target = zoo.DEFAULT_TARGET if config.target == "default" else config.target
    draft = zoo.DEFAULT_DRAFT if config.draft == "default" else config.draft
    return target, draft


def check_specs(config: DecoderConfig) -> None:
    """Both models findable here and the device available, before either is loaded.

    Raises:
        ValueError: an unknown model or path (no hub wait offline), an unavailable device.
    """
    target, draft = model_names(config)
    parse_device(config.device, target)
    for spec in (target, draft):
        if spec is not None:
            check_model_spec(spec)


def draft_vocab_limit(config: DecoderConfig) -> int | None:
    """config.draft_vocab_limit with "auto" resolved: the zoo's measured limit for zoo drafts."""
    if config.draft_vocab_limit != "auto":
        return config.draft_vocab_limit
    _, draft = model_names(config)
    return zoo.ZOO[draft].draft_vocab_limit if isinstance(draft, str) and draft in zoo.ZOO else None


class Pair:
    """The target and the draft of a DecoderConfig, loaded as `plan` says.

    Attributes:
        target, draft: Loaded (draft None: no draft model).
        tokenizer: the target's.  is_encoder_decoder: the target's kind (paper §4.1).
        dtype, draft_dtype: torch dtypes.  device: where the draft runs and tokens go in.
        cross_vocab: whether the draft's tokenizer differs from the target's (its drafts go
            through the shared vocabulary: specdecode.proposers.cross_vocab).
    Raises:
        ValueError, FileNotFoundError: as SpeculativeDecoder.
    """

    def __init__(self, config: DecoderConfig, plan: LoadPlan, *, tokenizer=None, draft_tokenizer=None,
                 progress=None):
        self.dtype = plan.target_kernel.dtype
        self.draft_dtype = DRAFT_KERNEL_DTYPES[plan.draft_kernel]
        target, draft = model_names(config)
        check_specs(config)
        self.device = parse_device(config.device, target)  # with a device_map: set again once placed
        if plan.target_kernel.backend == "llama.cpp":
            self.target = _load_gguf(target, LLAMA_WEIGHTS[plan.target_kernel], plan.max_rows, progress)
        elif plan.target_kernel is TargetKernel.GGUF_INVARIANT:
            self.target = _load_kquant(target, progress)
        else:
            self.target = self._load(target, tokenizer, progress, device_map=config.device_map,
                                     offload_folder=config.offload_folder)
        if config.device_map is not None:
            self.device = self.target.backend.device  # the draft runs where the target's tokens go in
            if self.device.type != "cpu" and config.quantize_draft in QUANTIZATION_BITS:
                raise ValueError(f"quantize_draft={config.quantize_draft!r}: the int8/int4 draft kernels run on the "
                                 f"CPU only; the device_map put the target on {self.device}: pass 'auto' or 'none'")
        if config.max_model_len is not None:  # a lower limit than the model's own window
            own = self.target.backend.max_length
            self.target.backend.max_length = config.max_model_len if own is None else min(own, config.max_model_len)
        self.tokenizer = self.target.tokenizer
        self.is_encoder_decoder = isinstance(self.target.backend, Seq2SeqLM)
        if self.is_encoder_decoder and isinstance(draft, str) and draft in zoo.ZOO:
            # the zoo holds decoder-only models only: fail before loading one (and "default" is one)
            raise ValueError(f"target {self.target.name!r} is an encoder-decoder model; the zoo draft "
                             f"{draft!r} is decoder-only. Pass an encoder-decoder draft (e.g. "
                             "google/flan-t5-small for a flan-t5 target) or draft=None")
        if self.is_encoder_decoder and config.tree_width > 1:
            raise ValueError("token trees (tree_width > 1) need a decoder-only target")
        if config.tree_width > 1 and getattr(self.target.backend, "sliding", False):
            raise ValueError(f"target {self.target.name!r} uses sliding-window attention; token trees "
                             "(tree_width > 1) need full attention")
        self.draft, self.cross_vocab = None, False
        if draft is not None and plan.draft_quantization == "gguf":
            self.draft = _load_gguf(draft, None, plan.max_rows, progress)
        elif draft is not None and plan.draft_quantization is not None:
            own_tokenizer = draft_tokenizer or tokenizer or self.tokenizer
            self.draft = self._load(draft, own_tokenizer, progress, draft_vocab_limit(config),
                                    plan.draft_quantization, asked=config.quantize_draft in QUANTIZATION_BITS)
            self.draft.backend.one_row_onednn = plan.draft_kernel != "bfloat16-gemv"
            if plan.draft_kernel == "bfloat16-sdpa":
                self.draft.backend.eager_attention = False
            if plan.draft_kernel == "native" and invariant_usable(self.draft.backend.model):
                self.draft.backend.use_invariant_forward()
        if self.draft is not None:
            if draft_tokenizer is not None:  # the draft's own, given for a draft loaded by name or path too
                self.draft = Loaded(self.draft.backend, draft_tokenizer, self.draft.name, self.draft.weights)
            self.cross_vocab = not same_tokenizer(self.tokenizer, self.draft.tokenizer)
            self._check_pair(config.tree_width)
        if isinstance(self.target.backend, HFCausalLM) and not plan.target_kernel.reads_gguf:
            # a model object is the user's, and a device_map's layers may sit on other devices or disk
            self._apply_target_kernel(plan, own=isinstance(target, str) and config.device_map is None,
                                      gamma=config.num_speculative_tokens)
        if config.batch_invariant is True and not getattr(self.target.backend, "batch_invariant", False):
            raise ValueError(f"batch_invariant=True: the batch-invariant kernels run bfloat16 Llama/Qwen2 targets "
                             f"and Q4_K/Q6_K GGUF files on the CPU; {self.target.name!r} is not one (pass "
                             "batch_invariant='auto')")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation: the model's (its generation config's, or llama.cpp's
        end-of-generation set), the tokenizer's, and a zoo model's known ones."""
        backend, tokenizer = self.target.backend, self.tokenizer
        if isinstance(backend, LlamaCppLM):
            known = zoo.ZOO[self.target.name].eos_token_ids if self.target.name in zoo.ZOO else ()
            return frozenset({*backend.eos_token_ids, *known} | ({tokenizer.eos_token_id} - {None}))
        return eos_token_ids(backend.model, tokenizer)

    def _apply_target_kernel(self, plan: LoadPlan, own: bool, gamma: int) -> None:
        """own: a model this process loaded whole on self.device, whose layers may be replaced."""
        backend = self.target.backend
        if plan.target_kernel is TargetKernel.FLOAT32_PACKED and self.device.type == "cpu" and own \
                and isinstance(backend, HFCausalLM) and packed.available() and lean_supports(backend.model):
            # float32 targets we loaded (Llama/Qwen2 family) get packed weights: the same IEEE
            # float32 products without the BLAS library's jump from one row to two
            packed.pack_linears(backend.model, gamma + 1)
        if plan.target_kernel is TargetKernel.BFLOAT16_INVARIANT:
            # the plan asks for it where the kernels build (specdecode.tune); the model's kind is
            # known only now (another kind keeps torch's bfloat16). A model object is the user's:
            # its weights are copied, not shared.
            if self.device.type == "cpu" and invariant_usable(backend.model):
                backend.use_invariant_forward(share=own)
                return
        backend.one_row_onednn = plan.target_kernel is not TargetKernel.BFLOAT16_GEMV
        if plan.upcast_wide_reads and self.dtype == torch.bfloat16 and own:
            packed.upcast_wide_linears(backend.model)  # prompt reads as float32 products of the same values

    def _check_pair(self, tree_width: int) -> None:
        if self.cross_vocab and (self.is_encoder_decoder or isinstance(self.draft.backend, Seq2SeqLM)):
            raise ValueError(f"draft tokenizer ({self.draft.name!r}) differs from target tokenizer "
                             f"({self.target.name!r}): drafts of another vocabulary need decoder-only models; "
                             "pick a draft from the target's family, or pass draft=None")
        if self.cross_vocab and tree_width > 1:
            raise ValueError("token trees (tree_width > 1) need a draft with the target's tokenizer")
        if self.is_encoder_decoder != isinstance(self.draft.backend, Seq2SeqLM):
            kinds = {True: "an encoder-decoder", False: "a decoder-only"}
            raise ValueError(
                f"target {self.target.name!r} is {kinds[self.is_encoder_decoder]} model but draft "
                f"{self.draft.name!r} is {kinds[not self.is_encoder_decoder]} one; pick a draft of the "
                "same kind (e.g. flan-t5-small for a flan-t5 target)")
        if self.is_encoder_decoder and \
                self.draft.backend.decoder_start_token_id != self.target.backend.decoder_start_token_id:
            raise ValueError(
                f"draft {self.draft.name!r} starts its decoder from token "
                f"{self.draft.backend.decoder_start_token_id}, target {self.target.name!r} from "
                f"{self.target.backend.decoder_start_token_id}; they must agree")

    def _load(self, spec, tokenizer, progress, vocab_limit=None, quantization: str | None = None,
              device_map=None, offload_folder=None, asked: bool = False) -> Loaded:
        """quantization: the draft's kind ("int4", "int8", "none"), None for the target; asked:
        the user named that kind (a refusal raises rather than falling back)."""
        given = isinstance(spec, torch.nn.Module)
        bits = QUANTIZATION_BITS.get(quantization)
        if given:
            if tokenizer is None:
                raise ValueError("a target given as a loaded model needs tokenizer=")
            seq2seq = getattr(spec.config, "is_encoder_decoder", False)
            model, tok, name = (copy.deepcopy(spec) if bits and not seq2seq else spec), tokenizer, type(spec).__name__
        else:
            dtype = self.dtype if quantization is None else self.draft_dtype
            model, tok, name = load_model(spec, dtype, progress, device_map, offload_folder)
            seq2seq = getattr(model.config, "is_encoder_decoder", False)
        if bits and seq2seq:
            if asked:
                raise ValueError("quantize_draft supports decoder-only drafts only")
            bits = None
        if bits and not asked and self.device.type != "cpu":
            bits = None  # the default's int kernels are CPU kernels (a device_map placed the target elsewhere)
        if bits and not asked and next(model.parameters()).dtype == torch.float64:
            # the default picks what works: the int kernels take float32 and bfloat16 activations
            warnings.warn("the float64 draft keeps its weights: the int8/int4 draft kernels need float32 or "
                          "bfloat16 (quantize_draft='none' says so explicitly)", stacklevel=4)
            bits = None
        if bits:
            prepare_draft_cached(model, bits, None if given else spec, progress)
        if device_map is None and next(model.parameters()).device != self.device:
            model.to(self.device)
        weights = str(next(model.parameters()).dtype).removeprefix("torch.") + (f", {quantization} layers" if bits else "")
        return Loaded(backend(model, vocab_limit, lean=quantization is not None), tok, name, weights)


def _load_gguf(spec, weights: str | None, max_rows: int, progress) -> Loaded:
    """A zoo name or GGUF path on llama.cpp: its file as it is (weights None), or converted once
    to "bf16" or "f32" by llama.cpp (specdecode.models.gguf_convert)."""
    from specdecode.models import llamacpp
    from specdecode.models.gguf_convert import converted_gguf

    source = gguf_source(spec, progress)
    if source is None:
        raise ValueError(f"{spec!r} is not a GGUF file or a zoo name: the llama.cpp backend runs GGUF files "
                         "(pass backend='torch' for a transformers directory)")
    path = source if weights is None else converted_gguf(source, weights, progress)
    if progress:
        progress(f"loading {Path(path).name} on llama.cpp")
    model, tokenizer = llamacpp.load_gguf(path, max_rows=max_rows)
    return Loaded(model, tokenizer, spec if isinstance(spec, str) else str(spec), f"{model.description} GGUF")


def _load_kquant(spec, progress) -> Loaded:
    """A zoo name or GGUF path's target on its file's own K-quant blocks (models/kquant.py)."""
    from specdecode.models import kquant
    from specdecode.models.gguf_files import gguf_tokenizer

    source = gguf_source(spec, progress)
    if source is None:
        raise ValueError(f"{spec!r} is not a GGUF file or a zoo name: dtype='gguf' reads a GGUF file's own weights")
    if progress:
        progress(f"loading {Path(source).name} on specdecode's K-quant kernels")
    eos = zoo.ZOO[spec].eos_token_ids if isinstance(spec, str) and spec in zoo.ZOO else ()
    model = kquant.kquant_model(source, eos)
    return Loaded(model, gguf_tokenizer(source), spec if isinstance(spec, str) else str(spec),
                  f"{kquant.describe(source)} GGUF")


def backend(model, vocab_limit: int | None = None, lean: bool = False):
    """The engine backend over a loaded transformers model. lean: a draft's backend, which may use
    the lean forward (models/lean.py).

    Raises:
        ValueError: vocab_limit with an encoder-decoder model.
    """
    if not getattr(model.config, "is_encoder_decoder", False):
        return HFCausalLM(model, vocab_limit, lean=lean)
    if vocab_limit is not None:
        raise ValueError("draft_vocab_limit is supported for decoder-only drafts only; pass "
                         "draft_vocab_limit=None with an encoder-decoder draft")
    return Seq2SeqLM(model)
