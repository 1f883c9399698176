"""A loaded target and draft, ready for the engine: each loaded by name, path, hub id or as a
model object, in a dtype, on a device (or spread by a device_map), the draft's weights int8/int4
(paper §3.6: only the proposal changes, so exactness holds), and the pair checked.

With dtype "auto" the dtypes, kernels and γ come from the measured choice for this machine and
pair (specdecode.measure.autoconfig; cached per machine), applied here.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from specdecode.measure import autoconfig
from specdecode.measure.choice import Choice
from specdecode.measure.hardware import cpu_report, describe, native_bfloat16
from specdecode.models import packed, zoo
from specdecode.models.hf import HFCausalLM
from specdecode.models.lean import supports as lean_supports
from specdecode.models.loading import check_model_spec, load_model, parse_device, parse_dtype
from specdecode.models.quant_cache import prepare_draft_cached
from specdecode.models.seq2seq import Seq2SeqLM

QUANTIZATIONS = {"int8": 8, "int4": 4, "none": None}  # quantize_draft's kinds → bits
DEFAULT_DRAFT_QUANTIZATION = "int4"
# dtype="auto" times kernels for targets this large; below, a forward's fixed overhead hides the
# dtype's kernels, and bfloat16 stays (as for tiny test models)
AUTO_MIN_PARAMETERS = 100_000_000


def free_drafts(prompt_lookup: bool | str) -> str | bool:
    """prompt_lookup as build_proposer takes it: True means suffix drafts."""
    return "suffix" if prompt_lookup is True else prompt_lookup


def same_tokenizer(target_tokenizer, draft_tokenizer) -> bool:
    """Whether the two tokenizers map every string to the same id (DESIGN.md rule 6); if not, the
    draft proposes through the shared vocabulary (specdecode.proposers.cross_vocab)."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


@dataclass(frozen=True)
class Loaded:
    backend: HFCausalLM | Seq2SeqLM
    tokenizer: object
    name: str


class Pair:
    """Loads a target and a draft (arguments as SpeculativeDecoder's, which documents them).

    Attributes:
        target, draft: Loaded (draft None: plain decoding, also where auto chose it).
        tokenizer: the target's.  is_encoder_decoder: the target's kind (paper §4.1).
        dtype, draft_dtype: torch dtypes.  device: where the draft runs and tokens go in.
        choice: autoconfig's Choice, or None (dtype given, model object, target too small).
        num_speculative_tokens: γ_max (auto may lower it).  prompt_lookup: which free drafts come
            first: "suffix", "ngram" or False.
        cross_vocab: whether the draft's tokenizer differs from the target's (its drafts go
            through the shared vocabulary: specdecode.proposers.cross_vocab).
    Raises:
        ValueError, FileNotFoundError: as SpeculativeDecoder.
    """

    def __init__(self, target, draft, *, tokenizer=None, dtype=None, device=None, device_map=None,
                 offload_folder: str | None = None, quantize_draft=None, draft_vocab_limit="auto",
                 num_speculative_tokens: int = 8, prompt_lookup: bool | None = None, tree_width: int = 1,
                 progress=None, draft_tokenizer=None):
        if quantize_draft is False:  # the same as "none": our copy keeps the lean forward either way
            quantize_draft = "none"
        self.num_speculative_tokens = num_speculative_tokens
        # None: on with a draft model; True: suffix drafts, measured best (docs/suffix_drafts.md)
        self.prompt_lookup = free_drafts(draft is not None if prompt_lookup is None else prompt_lookup)
        self.dtype = parse_dtype(dtype)
        if device_map is not None and (device is not None or isinstance(target, torch.nn.Module)):
            raise ValueError("device_map places a target loaded by name or path; give it without device= and "
                             "with the target as a name or path")
        self.device = parse_device(device, target)  # with a device_map: set again once the target is placed
        if device_map is None:
            self._check_quantize_device(quantize_draft)
        target = zoo.DEFAULT_TARGET if target == "default" else target
        draft = zoo.DEFAULT_DRAFT if draft == "default" else draft
        if draft_vocab_limit == "auto":
            draft_vocab_limit = zoo.ZOO[draft].draft_vocab_limit if isinstance(draft, str) and draft in zoo.ZOO else None
        for spec in (target, draft):  # both checked before either is loaded
            if spec is not None:
                check_model_spec(spec)
        # dtype "auto" (None): timed on this machine, for models this process loads on the CPU
        auto = dtype in (None, "auto") and device_map is None and self.device.type == "cpu" \
            and not isinstance(target, torch.nn.Module)
        self.choice: Choice | None = None
        draft_kind, self.draft_dtype = quantize_draft, self.dtype
        if auto:
            key = autoconfig.cache_key(str(target), None if draft is None else str(draft), num_speculative_tokens)
            self.choice = autoconfig.load_choice(key)
            if self.choice is not None:  # measured before: load what was chosen
                self.dtype = self.draft_dtype = autoconfig.KERNEL_DTYPES[self.choice.target_kernel]
                if self.choice.draft_kernel is not None:
                    self.draft_dtype = autoconfig.KERNEL_DTYPES[self.choice.draft_dtype]
                    if quantize_draft is None:
                        draft_kind = self.choice.draft_kernel
        self.target = self._load(target, tokenizer, progress, device_map=device_map, offload_folder=offload_folder)
        if device_map is not None:
            self.device = self.target.backend.device  # the draft runs where the target's tokens go in
            self._check_quantize_device(quantize_draft)
        self.tokenizer = self.target.tokenizer
        self.is_encoder_decoder = isinstance(self.target.backend, Seq2SeqLM)
        self.draft, self.cross_vocab = None, False
        if self.is_encoder_decoder and isinstance(draft, str) and draft in zoo.ZOO:
            # the zoo holds decoder-only models only: fail before loading one (and "default" is one)
            raise ValueError(f"target {self.target.name!r} is an encoder-decoder model; the zoo draft "
                             f"{draft!r} is decoder-only. Pass an encoder-decoder draft (e.g. "
                             "google/flan-t5-small for a flan-t5 target) or draft=None")
        if self.is_encoder_decoder and tree_width > 1:
            raise ValueError("token trees (tree_width > 1) need a decoder-only target")
        plain_chosen = self.choice is not None and self.choice.draft_kernel is None
        if draft is not None and not plain_chosen:
            self.draft = self._load(draft, draft_tokenizer or tokenizer or self.tokenizer, progress, draft_vocab_limit,
                                    draft_kind, dtype=self.draft_dtype)
            if draft_tokenizer is not None:  # the draft's own, given for a draft loaded by name or path too
                self.draft = Loaded(self.draft.backend, draft_tokenizer, self.draft.name)
            self.cross_vocab = not same_tokenizer(self.tokenizer, self.draft.tokenizer)
            self._check_pair(tree_width)
        if auto and self.choice is None and not self.is_encoder_decoder \
                and self.target.backend.model.num_parameters() >= AUTO_MIN_PARAMETERS:
            drafts = {}
            if self.draft is not None:
                drafts[autoconfig.draft_kernel(self.draft.backend.model)] = self.draft.backend.model
                for kind in QUANTIZATIONS if quantize_draft is None and not isinstance(draft, torch.nn.Module) else ():
                    if kind not in drafts:  # the other kernels the default would allow
                        drafts[kind] = self._load(draft, self.tokenizer, None, draft_vocab_limit, kind,
                                                  dtype=torch.bfloat16).backend.model
            self.choice = autoconfig.measure_and_choose(self.target.backend.model, drafts, draft_vocab_limit,
                                                        num_speculative_tokens, progress)
            del drafts
            autoconfig.save_choice(key, self.choice)
            if autoconfig.KERNEL_DTYPES[self.choice.target_kernel] != self.dtype:  # load the chosen dtype
                self.dtype = autoconfig.KERNEL_DTYPES[self.choice.target_kernel]
                self.target = self._load(target, tokenizer, progress)
                self.tokenizer = self.target.tokenizer
            wanted = self.choice.draft_kernel
            if self.draft is not None and wanted is not None and (
                    autoconfig.KERNEL_DTYPES[self.choice.draft_dtype] != self.draft_dtype
                    or autoconfig.draft_kernel(self.draft.backend.model) != wanted):
                self.draft_dtype = autoconfig.KERNEL_DTYPES[self.choice.draft_dtype]
                self.draft = self._load(draft, tokenizer or self.tokenizer, progress, draft_vocab_limit, wanted,
                                        dtype=self.draft_dtype)
        if self.choice is not None and self.choice.draft_kernel is None:
            # plain decoding measured fastest on this machine: no draft, and no prompt lookup
            # unless asked for (its drafts cost a multi-token verify too)
            self.draft = None
            self.prompt_lookup = free_drafts(prompt_lookup or False)
        if self.dtype == torch.float32 and self.device.type == "cpu" and device_map is None and packed.available() \
                and not isinstance(target, torch.nn.Module) and lean_supports(self.target.backend.model):
            # float32 targets we loaded (Llama/Qwen2 family) get packed weights, asked for or chosen:
            # the same IEEE float32 products without the BLAS library's jump from one row to two
            packed.pack_linears(self.target.backend.model, num_speculative_tokens + 1)
        if self.choice is not None:
            self.target.backend.one_row_onednn = self.choice.target_kernel not in autoconfig.ONE_ROW_WITHOUT_ONEDNN
            if self.dtype == torch.bfloat16 and not native_bfloat16():
                # prompt reads as float32 products of the same values (models/packed.py)
                packed.upcast_wide_linears(self.target.backend.model)
            if self.draft is not None:
                self.draft.backend.one_row_onednn = self.choice.draft_dtype not in autoconfig.ONE_ROW_WITHOUT_ONEDNN
                self.num_speculative_tokens = self.choice.gamma
            if progress:
                progress(f"chose for this machine ({describe(cpu_report())}): {self.choice.describe()}")
        if tree_width > 1 and getattr(self.target.backend, "sliding", False):
            raise ValueError(f"target {self.target.name!r} uses sliding-window attention; token trees "
                             "(tree_width > 1) need full attention")

    def _check_quantize_device(self, quantize_draft) -> None:
        if self.device.type != "cpu" and quantize_draft not in (None, False, "none"):
            raise ValueError(f"quantize_draft={quantize_draft!r}: the int8/int4 draft kernels run on the CPU only; "
                             f"on {self.device} pass quantize_draft=None or 'none'")

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

    def _load(self, spec, tokenizer, progress, vocab_limit=None, quantization: bool | str | None = False,
              device_map=None, offload_folder=None, dtype: torch.dtype | None = None) -> Loaded:
        """quantization: as SpeculativeDecoder's quantize_draft (False for a target); device_map and
        offload_folder: as SpeculativeDecoder's (the target's only); dtype: for a model loaded by
        name or path (None: self.dtype)."""
        given = isinstance(spec, torch.nn.Module)
        asked = quantization not in (None, False, "none")
        if quantization is True or (quantization is None and not given and self.device.type == "cpu"):
            quantization = DEFAULT_DRAFT_QUANTIZATION
        bits = QUANTIZATIONS[quantization] if quantization else None
        if given:
            if tokenizer is None:
                raise ValueError("a target given as a loaded model needs tokenizer=")
            seq2seq = getattr(spec.config, "is_encoder_decoder", False)
            model, tok, name = (copy.deepcopy(spec) if bits and not seq2seq else spec), tokenizer, type(spec).__name__
        else:
            model, tok, name = load_model(spec, dtype or self.dtype, progress, device_map, offload_folder)
            seq2seq = getattr(model.config, "is_encoder_decoder", False)
        if bits and seq2seq:
            if asked:
                raise ValueError("quantize_draft supports decoder-only drafts only")
            bits = None
        if bits and not asked and next(model.parameters()).dtype == torch.float64:
            # the default picks what works: the int kernels take float32 and bfloat16 activations
            warnings.warn("the float64 draft keeps its weights: the int8/int4 draft kernels need float32 or "
                          "bfloat16 (quantize_draft='none' says so explicitly)", stacklevel=4)
            bits = None
        if bits:
            prepare_draft_cached(model, bits, None if given else spec, progress)
        if device_map is None and next(model.parameters()).device != self.device:
            model.to(self.device)
        return Loaded(self._backend(model, vocab_limit, lean=quantization is not False), tok, name)

    @staticmethod
    def _backend(model, vocab_limit, lean=False):
        """lean: a draft's backend, which may use the lean forward (models/lean.py)."""
        if not getattr(model.config, "is_encoder_decoder", False):
            return HFCausalLM(model, vocab_limit, lean=lean)
        if vocab_limit is not None:
            raise ValueError("draft_vocab_limit is supported for decoder-only drafts only; pass "
                             "draft_vocab_limit=None with an encoder-decoder draft")
        return Seq2SeqLM(model)
