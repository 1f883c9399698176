"""SpeculativeDecoder: the public entry point. Loads the target and draft, validates every input
at the boundary, and runs the decoding loop (specdecode.decoding)."""

from __future__ import annotations

import copy
import operator
import os
import socket
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from specdecode.models import zoo
from specdecode.batch import decode_batch
from specdecode.decoding import DecodeConfig, GenerationResult, TokenEvent, decode
from specdecode.models import HFBatchedCausalLM, HFCausalLM, Seq2SeqLM
from specdecode.models.hf_batch import supports_batching
from specdecode.models.quant_cache import prepare_draft_cached
from specdecode.proposers import DraftModelProposer, PromptLookupProposer
from specdecode.sampling import SamplingParams
from specdecode.measure.timing import measure_costs

# Defaults, exact, chosen on HumanEval: prompt lookup first; otherwise the draft, with int4
# weights and eager attention, scoring only the first 32768 ids, drafts up to 8 tokens, stopping
# once it is less than 40% sure of its own token. Fixed γ ≤ 8 beat the adaptive schedule on the
# 20-prompt set (docs/bench_code_t0_fixed_gamma8.md 2.26x vs docs/bench_code_t0.md 2.07x) and
# tied it on 5 held-out prompts once the guard's estimator was fixed; confidence 0.4 beat 0.2 and
# int4 tied int8 there (docs/tune_draft.md) with a cheaper draft step (c 0.12 vs 0.19).
DEFAULT_GAMMA = 8
DEFAULT_DRAFT_CONFIDENCE = 0.4
DEFAULT_GAMMA_SCHEDULE = "fixed"
DEFAULT_DRAFT_QUANTIZATION = "int4"
QUANTIZATIONS = {"int8": 8, "int4": 4, "none": None}  # quantize_draft's kinds → bits
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    """None → bfloat16 (a k-token verify costs about one step there; DESIGN.md §8)."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _hub_reachable(host: str = "huggingface.co") -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def check_model_spec(spec) -> None:
    """Fail fast, before any model is loaded, on a spec that cannot load here.

    Raises:
        ValueError: not a zoo name, not an existing directory, and (for a hub id) no local copy
            in the Hugging Face cache while the hub is unreachable.
    """
    if isinstance(spec, torch.nn.Module) or spec in zoo.ZOO:
        return
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a zoo name, a local path or a hub id, got {spec!r}")
    if os.path.isdir(spec):
        return
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep + os.sep in spec
    if looks_like_path:
        raise ValueError(f"model path {spec!r} does not exist. Known offline models: {', '.join(zoo.ZOO)}")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(spec, "config.json"), str) and not _hub_reachable():
        raise ValueError(
            f"cannot load model {spec!r}: it is not in the local Hugging Face cache and the hub is "
            f"unreachable from here. Known offline models: {', '.join(zoo.ZOO)}; or pass a local "
            "directory saved with save_pretrained.")


def load_model(spec, dtype: torch.dtype, progress: Callable[[str], None] | None = None):
    """A zoo name, a local directory or a hub id → (model, tokenizer, name). A config with
    is_encoder_decoder (T5, BART, ...) loads through AutoModelForSeq2SeqLM, others as causal LMs.

    Raises:
        ValueError: the model cannot be found or loaded here (the message says what to do).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
    )

    check_model_spec(spec)
    if spec in zoo.ZOO:
        model, tokenizer = zoo.load_zoo_model(spec, dtype, progress)
        return model, tokenizer, spec
    if progress:
        progress(f"loading {spec}")
    try:
        seq2seq = getattr(AutoConfig.from_pretrained(spec), "is_encoder_decoder", False)
        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        model = auto.from_pretrained(spec, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load model {spec!r}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    return model.eval(), tokenizer, spec


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Raises ValueError if the two tokenizers map any string to different ids (DESIGN.md rule 6)."""
    if target_tokenizer is draft_tokenizer:
        return
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft tokenizer ({draft_name!r}) differs from target tokenizer ({target_name!r}); "
            "pick a draft from the target's family, or pass draft=None")


@dataclass(frozen=True)
class _Loaded:
    backend: HFCausalLM | Seq2SeqLM
    tokenizer: object
    name: str


class GenerationStream:
    """Iterate (once) for TokenEvents as tokens are accepted; `.result` is set when it ends.

    Raises (while iterating):
        RuntimeError: iterated a second time, or another generate() call on the same decoder
            took over its models' caches before this stream finished.
    """

    def __init__(self, events: Iterator[TokenEvent], decoder: "SpeculativeDecoder"):
        self._events = events
        self._decoder = decoder
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._started:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._started = True
        while True:
            # The target and draft caches belong to the decoder, not to the stream: a stream that
            # resumed after another request reset them would continue from the wrong prefix.
            if self._decoder._owner is not self:
                raise RuntimeError("another generate() call on this decoder started before this stream "
                                   "finished; finish a stream before starting the next request")
            try:
                event = next(self._events)
            except StopIteration as done:
                self.result = done.value
                return
            yield event


class SpeculativeDecoder:
    """Exact speculative decoding of a target model with a draft model (paper Algorithm 1).

    Args:
        target: "default" (the zoo pair's target), a zoo name, a local path, a hub id, or a loaded
            transformers PreTrainedModel (then `tokenizer` is required).
        draft: "default", a zoo name, path, hub id, PreTrainedModel, or None for plain decoding.
            It must use the target's tokenizer (checked for drafts loaded by name or path; a
            draft given as a loaded model is taken to share the target's tokenizer).
            An encoder–decoder target (config.is_encoder_decoder: T5, flan-t5, BART; paper
            §4.1) needs an encoder–decoder draft: the prompt is the encoder's input and both
            decoders start from decoder_start_token_id (specdecode.models.Seq2SeqLM).
        tokenizer: the tokenizer for a target given as a loaded model.
        num_speculative_tokens: γ, the most drafts per target call (>= 1; default 8).
        draft_confidence: stop drafting early once the draft's probability of its own token is
            below this (dynamic γ, exact; default 0.4); 0 always drafts γ tokens.
        draft_vocab_limit: the draft scores only token ids below this (a cheaper LM head; exact,
            since q is zero elsewhere); None scores the whole vocabulary; "auto" (default) uses
            the zoo's measured limit for zoo drafts and None for others.
        prompt_lookup: first try to copy the continuation of an earlier occurrence of the last
            tokens (paper §3.6, free drafts); the draft model serves the other steps. None
            (default): on when there is a draft model. With draft=None and prompt_lookup=True,
            lookup is the only proposer; draft=None alone is plain decoding.
        quantize_draft: "int8" (per-row scales) or "int4" (groups of 32 with scale and zero):
            store the draft's linear layers as integers, weight-only, for a cheaper draft step;
            still exact, since only the proposal changes (paper §3.6). "none" or False keeps its
            weights; True means the default kind (DEFAULT_DRAFT_QUANTIZATION). None (default):
            the default kind for a draft loaded by name or path, none for a draft given as a
            loaded model (a kind or True quantizes a copy of it; the user's object is never
            changed) and for encoder–decoder drafts (their layers read .weight directly; asking
            for a kind raises).
        gamma_schedule: "fixed" drafts up to γ every step; "adaptive" starts at 4, adds 2 after a
            fully accepted block and drops 1 otherwise, within [1, γ] (transformers' "heuristic"
            schedule). Exact either way (the choice looks only at the past).
        guard: pause drafting while the request's acceptances say it does not pay (Cor. 3.9's
            α > c checked at run time, specdecode.engine.guard), probing again every 16 steps. Exact
            either way. Seeded sampled requests are not guarded, so that a seed gives the same
            output alone, in a batch and in another process. Default True.
        guard_costs: (c, slope) for the guard: c = a draft forward's time over a target step's,
            slope = (r(γ+1) − 1) / γ, the extra cost of each verified draft in target steps. None
            (default) measures both once here (a few forwards of each model, ~3 s on the zoo pair).
        dtype: "bfloat16" (default), "float32" or "float16" for models loaded by name.
        progress: called with one-line messages while models are assembled and loaded.
    Raises:
        ValueError: unknown model, tokenizers that differ, an encoder–decoder model paired with a
            decoder-only one, draft_vocab_limit on an encoder–decoder draft, γ < 1, unknown dtype.
        FileNotFoundError: the default pair's part packages are not installed.
    """

    def __init__(self, target="default", draft="default", *, tokenizer=None,
                 num_speculative_tokens: int = DEFAULT_GAMMA, draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE,
                 draft_vocab_limit: int | str | None = "auto", prompt_lookup: bool | None = None,
                 quantize_draft: bool | str | None = None, gamma_schedule: str = DEFAULT_GAMMA_SCHEDULE, guard: bool = True,
                 guard_costs: tuple[float, float] | None = None, dtype=None,
                 progress: Callable[[str], None] | None = None):
        if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens (γ) must be an integer >= 1, got {num_speculative_tokens!r}")
        if not 0 <= draft_confidence < 1:
            raise ValueError(f"draft_confidence must be in [0, 1), got {draft_confidence!r}")
        if gamma_schedule not in ("fixed", "adaptive"):
            raise ValueError(f"gamma_schedule must be 'fixed' or 'adaptive', got {gamma_schedule!r}")
        self.gamma_schedule = gamma_schedule
        if guard_costs is not None and (len(guard_costs) != 2 or not all(x >= 0 for x in guard_costs)):
            raise ValueError(f"guard_costs must be two numbers >= 0 (c, slope), got {guard_costs!r}")
        if not (quantize_draft is None or isinstance(quantize_draft, bool) or quantize_draft in QUANTIZATIONS):
            raise ValueError(f"quantize_draft must be one of {', '.join(QUANTIZATIONS)}, True, False or None, "
                             f"got {quantize_draft!r}")
        if draft_vocab_limit not in (None, "auto") and (
                not isinstance(draft_vocab_limit, int) or draft_vocab_limit < 1):
            raise ValueError(f"draft_vocab_limit must be a positive integer, 'auto' or None, got {draft_vocab_limit!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_confidence = draft_confidence
        self.prompt_lookup = (draft is not None) if prompt_lookup is None else prompt_lookup
        self.dtype = parse_dtype(dtype)
        target = zoo.DEFAULT_TARGET if target == "default" else target
        draft = zoo.DEFAULT_DRAFT if draft == "default" else draft
        if draft_vocab_limit == "auto":
            draft_vocab_limit = zoo.ZOO[draft].draft_vocab_limit if isinstance(draft, str) and draft in zoo.ZOO else None
        for spec in (target, draft):  # both checked before either is loaded
            if spec is not None:
                check_model_spec(spec)
        self.target = self._load(target, tokenizer, progress)
        self.tokenizer = self.target.tokenizer
        self.is_encoder_decoder = isinstance(self.target.backend, Seq2SeqLM)
        self.draft = None
        if self.is_encoder_decoder and isinstance(draft, str) and draft in zoo.ZOO:
            # the zoo holds decoder-only models only: fail before loading one (and "default" is one)
            raise ValueError(f"target {self.target.name!r} is an encoder-decoder model; the zoo draft "
                             f"{draft!r} is decoder-only. Pass an encoder-decoder draft (e.g. "
                             "google/flan-t5-small for a flan-t5 target) or draft=None")
        if draft is not None:
            self.draft = self._load(draft, tokenizer or self.tokenizer, progress, draft_vocab_limit, quantize_draft)
            check_same_tokenizer(self.tokenizer, self.draft.tokenizer, self.target.name, self.draft.name)
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
        self.eos_token_ids = self._eos_ids(self.target.backend.model, self.tokenizer)
        self._owner: GenerationStream | None = None
        self.guard_costs = None  # None: no guard
        if guard and self.draft is not None:
            self.guard_costs = guard_costs or self._measure_guard_costs(progress)

    def _measure_guard_costs(self, progress) -> tuple[float, float]:
        if progress:
            progress("measuring c (draft step / target step) and the verify cost r(γ+1) for the guard")
        vocab = min(self.target.backend.vocab_size, self.draft.backend.vocab_size)
        context = [i % vocab for i in range(100, 164)]
        if self.is_encoder_decoder:  # the decoders attend to an encoded input
            for loaded in (self.target, self.draft):
                loaded.backend.set_input(context)
        gamma = self.num_speculative_tokens
        costs = measure_costs(self.target.backend, self.draft.backend, context, [gamma + 1], repeats=3)
        return costs["c"], max(costs["r"][gamma + 1] - 1, 0.0) / gamma

    def _load(self, spec, tokenizer, progress, vocab_limit=None, quantization: bool | str | None = False) -> _Loaded:
        """quantization: as SpeculativeDecoder's quantize_draft (False for a target)."""
        given = isinstance(spec, torch.nn.Module)
        asked = quantization not in (None, False, "none")
        if quantization is True or (quantization is None and not given):
            quantization = DEFAULT_DRAFT_QUANTIZATION
        bits = QUANTIZATIONS[quantization] if quantization else None
        if given:
            if tokenizer is None:
                raise ValueError("a target given as a loaded model needs tokenizer=")
            seq2seq = getattr(spec.config, "is_encoder_decoder", False)
            model, tok, name = (copy.deepcopy(spec) if bits and not seq2seq else spec), tokenizer, type(spec).__name__
        else:
            model, tok, name = load_model(spec, self.dtype, progress)
            seq2seq = getattr(model.config, "is_encoder_decoder", False)
        if bits and seq2seq:
            if asked:
                raise ValueError("quantize_draft supports decoder-only drafts only")
            bits = None
        if bits:
            prepare_draft_cached(model, bits, None if given else spec, progress)
        return _Loaded(self._backend(model, vocab_limit), tok, name)

    @staticmethod
    def _backend(model, vocab_limit):
        if not getattr(model.config, "is_encoder_decoder", False):
            return HFCausalLM(model, vocab_limit)
        if vocab_limit is not None:
            raise ValueError("draft_vocab_limit is supported for decoder-only drafts only; pass "
                             "draft_vocab_limit=None with an encoder-decoder draft")
        return Seq2SeqLM(model)

    @staticmethod
    def _eos_ids(model, tokenizer) -> frozenset[int]:
        ids = set()
        for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return frozenset(ids)

    def _proposer(self, draft_backend=None):
        """The configured proposer; draft_backend replaces the draft's own (the benchmark wraps it)."""
        draft_backend = draft_backend or (self.draft.backend if self.draft is not None else None)
        proposer = DraftModelProposer(draft_backend, self.draft_confidence) if draft_backend is not None else None
        if self.prompt_lookup:
            proposer = PromptLookupProposer(self.target.backend.vocab_size, fallback=proposer)
        return proposer

    def _config(self, max_new_tokens, sampling, stop, lenience: float = 1.0) -> DecodeConfig:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        sampling = sampling or SamplingParams()
        # A seeded sampled request must give the same output alone, in a batch (which has no
        # guard) and in another process (which measures its own c): the guard stays out of it.
        # Exact greedy output does not depend on when drafting pauses (up to bf16 near-ties);
        # lenient greedy does (a paused step emits the argmax), so it is not guarded either.
        guarded = lenience == 1 if sampling.greedy else sampling.seed is None
        return DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling,
                            num_speculative_tokens=self.num_speculative_tokens, eos_token_ids=self.eos_token_ids,
                            stop=stops, lenience=lenience, costs=self.guard_costs if guarded else None,
                            gamma_schedule=self.gamma_schedule)

    def _can_batch(self) -> bool:
        """Lookup-only decoding has no batched form; sliding-window models have no batched backend."""
        if (self.draft is None and self.prompt_lookup) or self.is_encoder_decoder:
            return False
        loaded = [self.target] + ([self.draft] if self.draft is not None else [])
        return all(supports_batching(m.backend.model) for m in loaded)

    def _generate_batch(self, prompts: list[list[int]], config: DecodeConfig, batch_size: int) -> list[GenerationResult]:
        # Batched backends wrap the same model objects with caches of their own, so a paused
        # stream on this decoder keeps its state.
        target = HFBatchedCausalLM(self.target.backend.model, self.target.backend.vocab_size)
        draft = None
        if self.draft is not None:
            draft = HFBatchedCausalLM(self.draft.backend.model, self.draft.backend.vocab_size)
        results = []
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first:first + batch_size]
            results += decode_batch(target, draft, chunk, [config] * len(chunk), self.tokenizer,
                                    draft_confidence=self.draft_confidence)
        return results

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """A string (chat template applied per `chat`) or token ids → validated token ids. For an
        encoder–decoder target these are the encoder's input: a string is tokenized with the
        tokenizer's special tokens (T5's closing </s>) and never gets a chat template.

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, chat=True without a template
                (or with an encoder-decoder target).
        """
        if isinstance(prompt, str) and self.is_encoder_decoder:
            if chat:
                raise ValueError("chat=True: an encoder-decoder target takes its prompt as plain encoder input")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            has_template = bool(getattr(self.tokenizer, "chat_template", None))
            if chat and not has_template:
                raise ValueError("chat=True, but the target's tokenizer has no chat template")
            if chat is None:
                chat = has_template
            if chat:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False)
                ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            else:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            try:
                ids = [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d int tensors
            except TypeError:
                raise ValueError("a token-id prompt must be a list of integers, got "
                                 f"{[type(t).__name__ for t in prompt][:5]}") from None
            if any(isinstance(t, bool) for t in prompt):
                raise ValueError("a token-id prompt must be a list of integers, not booleans")
        if not ids:
            raise ValueError("prompt is empty; give at least one character or token id")
        bad = [t for t in ids if not 0 <= t < self.target.backend.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.target.backend.vocab_size})")
        limit = self.target.backend.max_length
        if limit is not None and len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the target's context window is {limit}")
        return ids

    def generate(self, prompt, *, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
                 stop: list[str] | str | None = None, stream: bool = False, chat: bool | None = None,
                 batch_size: int | None = None, lenience: float = 1.0):
        """Generate a continuation whose distribution is exactly the target's (paper §2.3).

        Args:
            prompt: a string, a list of token ids (used verbatim), or a list of either: a batch,
                decoded together (specdecode.batch), returning a list of results in order.
            max_new_tokens: at most this many new tokens (>= 1), per prompt.
            sampling: SamplingParams; default temperature 1.0. temperature=0 is greedy. In a batch
                every prompt gets its own generator from this seed, so each result equals the
                prompt's result alone with the same settings.
            stop: a string or list of strings that end the output (excluded from the text).
            stream: return a GenerationStream of TokenEvents instead of the result (one prompt).
            chat: apply the chat template (None: for string prompts when the target has one).
            batch_size: for a list of prompts, how many decode together: None = all, 1 = one
                after another. The batch path drafts with the draft model at fixed γ (with
                draft_confidence's dynamic γ) and skips prompt lookup, so that each row equals its
                result alone, sampling with prompt lookup on goes one at a time; so do lookup-only
                decoding (draft=None, prompt_lookup=True), encoder–decoder and sliding-window
                models, and lenience < 1.
            lenience: l in (0, 1]; 1 (default) is exact. l < 1 is LOSSY (paper A.5): it changes
                the output distribution (no token gets more than p(x)/l; greedy keeps a draft
                token with p(x) >= l·max p) and marks result.stats.lossy.
        Returns:
            GenerationResult (.text, .token_ids, .finish_reason, .stats, .origins), a list of
            them for a batch, or a GenerationStream.
        Raises:
            ValueError: bad prompt (any prompt of a batch, before anything is generated),
                max_new_tokens < 1, empty stop string, batch_size not None or >= 1, stream=True
                with a list, lenience outside (0, 1].
        """
        if isinstance(lenience, bool) or not isinstance(lenience, (int, float)) or not 0 < lenience <= 1:
            raise ValueError(f"lenience must be a number in (0, 1] (1 = exact; below 1 is lossy), got {lenience!r}")
        config = self._config(max_new_tokens, sampling, stop, float(lenience))
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be None (all at once) or an integer >= 1, got {batch_size!r}")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple)):
            if stream:
                raise ValueError("stream=True takes one prompt, not a list")
            # Encode (and so validate) every prompt before generating any; the ids go in verbatim.
            encoded = [self.encode(p, chat) for p in prompt]
            # The batch path drafts with the draft model only: with prompt lookup on, a seeded
            # sampled row would draw from its generator differently than alone (rule 7).
            sampled_lookup = self.prompt_lookup and not config.sampling.greedy
            if batch_size == 1 or lenience < 1 or sampled_lookup or not self._can_batch():
                return [self.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                      lenience=lenience) for ids in encoded]
            return self._generate_batch(encoded, config, batch_size or len(encoded))
        ids = self.encode(prompt, chat)
        if self.is_encoder_decoder:
            # Both encoders see the prompt once; Algorithm 1 then runs on the decoder tokens.
            for loaded in (self.target, self.draft):
                if loaded is not None:
                    loaded.backend.set_input(ids)
            ids = [self.target.backend.decoder_start_token_id]
        events = decode(self.target.backend, self._proposer(), ids, config, self.tokenizer)
        stream_ = GenerationStream(events, self)
        self._owner = stream_
        if stream:
            return stream_
        for _ in stream_:
            pass
        return stream_.result
