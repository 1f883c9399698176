"""SpeculativeDecoder: the public entry point, a thin facade. It checks its arguments and puts the
layers together: the models (specdecode.models.pair), the proposer (specdecode.proposers), the
request path (specdecode.frontend.builder) and the engine with its driver (specdecode.engine)."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Callable, Iterator

from specdecode import tune
from specdecode.progress import default as default_progress
from specdecode.config import DecoderConfig
from specdecode.engine.driver import Driver
from specdecode.engine.engine import Engine
from specdecode.engine.output import HeldTokens
from specdecode.engine.request import DecodeConfig, GenerationResult, Request, TokenEvent
from specdecode.frontend.builder import RequestBuilder, choice_samplings, generation_defaults, is_int as _is_int
from specdecode.frontend.schema import MAX_CHOICES
from specdecode.tune.hardware import cpu_report
from specdecode.models.loading import load_tokenizer
from specdecode.models.pair import Pair, check_specs
from specdecode.proposers import CrossVocabProposer, build_proposer, find_proposer
from specdecode.sampling import SamplingParams


class GenerationStream:
    """Iterate (once) for TokenEvents as tokens are accepted; `.result` is set when it ends.
    Other calls on the same decoder may run meanwhile (from any thread): their rows share the
    engine's batch. `close()` aborts the request if it has not finished; so does dropping the
    stream unfinished (its row leaves at the engine's next step).

    Raises (while iterating):
        RuntimeError: iterated a second time, or the batch's step failed in another caller.
    """

    def __init__(self, driver: Driver, request_id: int):
        self._driver, self._request_id = driver, request_id
        self._started = False
        self.result: GenerationResult | None = None
        self._finalizer = weakref.finalize(self, driver.abandon, request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._started:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._started = True
        # A token whose text a possible stop string holds back waits until its text is released:
        # if a stop cuts the output before it, it is past the cut and its logprob is dropped, as
        # result.logprobs and the server drop it (its id and any text it releases still come).
        held = HeldTokens()
        events = self._driver.stream(self._request_id)
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration as end:
                    self.result = end.value
                    break
                yield from held.push([event])
        finally:
            events.close()  # stopped early: the request is aborted now
        self._finalizer.detach()
        kept, past = held.finish(self.result.num_returned_tokens)
        yield from kept
        yield from (dataclasses.replace(event, logprob=None) for event in past)

    def close(self) -> None:
        """Abort the request if it has not finished (its row leaves the batch)."""
        if self.result is None:
            self._finalizer.detach()
            self._driver.abort(self._request_id)


class SpeculativeDecoder:
    """Exact speculative decoding of a target model with a draft model (paper Algorithm 1).

    Args:
        target: "default" (the zoo pair's target), a zoo name, a local directory, a GGUF file
            (torch dequantizes it; llama.cpp runs it: docs/llamacpp.md), a hub id, or a loaded
            transformers PreTrainedModel (then `tokenizer` is required).
        draft: the same forms, or None for plain decoding. An encoder–decoder target
            (config.is_encoder_decoder: T5, flan-t5, BART; paper §4.1) needs an encoder–decoder
            draft (specdecode.models.Seq2SeqLM).
        tokenizer: the tokenizer for a target given as a loaded model.
        progress: called with one-line messages while models are assembled, timed and loaded;
            None (default) logs them at INFO on the "specdecode" logger, which writes them to
            stderr while the application has configured no logging of its own.
        **options: any other field of specdecode.config.DecoderConfig, which documents each
            (num_speculative_tokens, draft_confidence, gamma_schedule, verification, tree_width,
            tree_confidence, free_drafts, draft_vocab_limit, quantize_draft, guard, guard_costs,
            dtype, backend, device, device_map, offload_folder, max_batch_size,
            use_generation_config, draft_tokenizer, cross_vocab). Old spellings still work with a
            DeprecationWarning (prompt_lookup → free_drafts, quantize_draft=True/False/None).
    Attributes:
        decoder_config: the validated DecoderConfig.  plan: what specdecode.tune chose to load
            (.choice: what dtype="auto" measured, or None).
    Raises:
        TypeError: an unknown option.
        ValueError: an option out of range or two that clash (DecoderConfig.validate), an unknown
            model, tokenizers that differ where a draft of another vocabulary cannot work, an
            encoder–decoder model paired with a decoder-only one, an unavailable device.
        FileNotFoundError: the default pair's part packages are not installed.
        ImportError: the llama.cpp backend asked for (backend, dtype="gguf", quantize_draft="gguf")
            without llama-cpp-python installed (the message says what to install).
    """

    def __init__(self, target="default", draft="default", *, tokenizer=None,
                 progress: Callable[[str], None] | None = None, **options):
        self._build(DecoderConfig.from_options(target=target, draft=draft, **options).validate(), tokenizer, progress)

    @classmethod
    def from_config(cls, config: DecoderConfig, *, tokenizer=None,
                    progress: Callable[[str], None] | None = None) -> "SpeculativeDecoder":
        """A decoder built from a DecoderConfig (as the CLI, the server and Ray workers build one)."""
        decoder = cls.__new__(cls)
        decoder._build(config.validate(), tokenizer, progress)
        return decoder

    def _build(self, config: DecoderConfig, tokenizer, progress) -> None:
        progress = progress or default_progress()
        self.decoder_config = config
        check_specs(config)  # both models findable, before anything is timed or loaded
        draft_tokenizer = load_tokenizer(config.draft_tokenizer) if isinstance(config.draft_tokenizer, str) \
            else config.draft_tokenizer
        self.plan = tune.plan(config, progress)
        self.pair = Pair(config, self.plan.load, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                         progress=progress)
        self.target, self.draft, self.tokenizer = self.pair.target, self.pair.draft, self.pair.tokenizer
        self.num_speculative_tokens, self.free_drafts = self.plan.gamma, self.plan.free_drafts
        self.cross_vocab = config.cross_vocab if self.pair.cross_vocab else None
        self.eos_token_ids = self.pair.eos_token_ids
        # a GGUF file on llama.cpp has no transformers generation_config: nothing to apply
        self.generation_defaults = generation_defaults(getattr(self.target.backend, "model", None)) \
            if config.use_generation_config else {}
        self.guard_costs = None  # None: no guard
        # free drafts alone are guarded too: they cost no forward, but each verified draft costs
        # its share of a wider target call (a Q4_K_M target on llama.cpp: r(5) = 1.8)
        if config.guard and (self.draft is not None or self.free_drafts):
            # given, else from the choice's own timings, else timed now (a few forwards)
            self.guard_costs = tuple(config.guard_costs) if config.guard_costs is not None else \
                self.choice.guard_costs(self.num_speculative_tokens) if self.choice is not None else None
            if self.guard_costs is None:
                if progress:
                    progress("measuring c (draft step / target step) and the verify costs r(2), r(γ+1) for the "
                             "guard (a few forwards; --no-guard skips it)")
                self.guard_costs = tune.guard_costs(self.target.backend,
                                                    self.draft.backend if self.draft is not None else None,
                                                    self.num_speculative_tokens, self.is_encoder_decoder)
        # the request path's own tokenizer: requests are built in other threads than the engine's
        self.requests = RequestBuilder(copy.deepcopy(self.tokenizer), self.target.backend, self.eos_token_ids,
                                       decoder=config, num_speculative_tokens=self.num_speculative_tokens,
                                       guard_costs=self.guard_costs, defaults=self.generation_defaults,
                                       is_encoder_decoder=self.is_encoder_decoder)
        self.engine = Engine(self.target.backend, self.proposer(), self.tokenizer, config.max_batch_size,
                             batch_guard=self.guard_costs is not None and self.draft is not None,
                             first_step_plain=True)
        self._driver = Driver(self.engine)

    # What was built, by the names earlier versions had.
    choice = property(lambda self: self.plan.choice)
    dtype = property(lambda self: self.pair.dtype)
    draft_dtype = property(lambda self: self.pair.draft_dtype)
    device = property(lambda self: self.pair.device)
    is_encoder_decoder = property(lambda self: self.pair.is_encoder_decoder)
    draft_confidence = property(lambda self: self.decoder_config.draft_confidence)
    gamma_schedule = property(lambda self: self.decoder_config.gamma_schedule)
    verification = property(lambda self: self.decoder_config.verification)
    tree_width = property(lambda self: self.decoder_config.tree_width)
    tree_confidence = property(lambda self: self.decoder_config.tree_confidence)
    prompt_lookup = property(lambda self: self.free_drafts)  # the free drafts' kind ("suffix", "ngram") or None

    def configuration(self) -> dict:
        """What runs, for reports (`generate --json`, the server's /v1/models, `bench`): {"dtype":
        the target's numbers ("bfloat16", "float32", ...; "gguf": its file's own quantization),
        "backend": "torch" or "llama.cpp", "target_kernel" (specdecode.models.pair.TargetKernel),
        "target_weights" and "draft_weights" (what each model's numbers are, e.g. "qwen2 1.5B BF16
        GGUF", "bfloat16, int4 layers"), "draft_dtype" (the draft's: any dtype keeps the output
        exact), "num_speculative_tokens": γ_max (0 without drafts), "free_drafts", "machine": this
        CPU (specdecode.tune.hardware.cpu_report), "choice": why dtype="auto" chose it (None
        when the dtype was given, the target was a model object, or it was too small to time),
        "draft_vocabulary": the shared vocabulary of a draft of another family, or None,
        "batch_invariant": whether each token's logits are the same bits alone, in a verify or
        beside other rows (DecoderConfig.batch_invariant)}."""
        choice, kernel = self.choice, self.plan.load.target_kernel
        return {"dtype": str(self.dtype).removeprefix("torch.") if self.dtype is not None else "gguf",
                "backend": kernel.backend, "target_kernel": kernel.value, "target_weights": self.target.weights,
                "draft_weights": self.draft.weights if self.draft is not None else None,
                "draft_dtype": (str(self.draft_dtype).removeprefix("torch.") if self.draft_dtype is not None
                                else "gguf") if self.draft is not None else None,
                "num_speculative_tokens": self.num_speculative_tokens if self.draft is not None or self.free_drafts
                else 0,
                "free_drafts": self.free_drafts,
                "batch_invariant": bool(getattr(self.target.backend, "batch_invariant", False)),
                "machine": cpu_report(),
                "choice": None if choice is None else {"summary": choice.describe(), "measured": list(choice.notes),
                                                       "prior": choice.prior},
                "draft_vocabulary": None if not self.cross_vocab else {
                    "shared_tokens": self.num_shared_tokens,
                    "method": {"auto": "TLI for sampled requests, SLEM for greedy ones", "tli": "TLI",
                               "slem": "SLEM"}[self.cross_vocab]}}

    def proposer(self, draft_backend=None, tree_width: int | None = None):
        """A new proposer as this decoder is configured (specdecode.proposers.build_proposer);
        draft_backend replaces the draft's own (the benchmark wraps it), tree_width the configured
        one (the benchmark compares them)."""
        draft_backend = draft_backend or (self.draft.backend if self.draft is not None else None)
        tokenizers = (self.draft.tokenizer, self.tokenizer) if self.cross_vocab else None
        proposer = build_proposer(draft_backend, self.target.backend.vocab_size, free_drafts=self.free_drafts,
                                  confidence=self.draft_confidence, tokenizers=tokenizers,
                                  device=self.target.backend.device,
                                  cross_vocab=self.cross_vocab or "auto",
                                  tree_width=self.tree_width if tree_width is None else tree_width,
                                  tree_confidence=self.tree_confidence)
        cross = find_proposer(proposer, CrossVocabProposer)
        if cross is not None:
            self.num_shared_tokens = cross.num_shared
        return proposer

    # The request path (specdecode.frontend.builder), as the facade's own methods.
    def config(self, max_new_tokens: int, sampling: SamplingParams | None = None, stop=None, lenience: float = 1.0,
               logprobs: int | None = None, logits_processors=None, response_format=None, grammar=None,
               prompt_logprobs: int | None = None) -> DecodeConfig:
        """The validated DecodeConfig of a request on this decoder (RequestBuilder.config)."""
        return self.requests.config(max_new_tokens, sampling, stop, lenience, logprobs, logits_processors,
                                    response_format, grammar, prompt_logprobs)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """A prompt → validated token ids (RequestBuilder.encode)."""
        return self.requests.encode(prompt, chat)

    def request(self, prompt, config: DecodeConfig, chat: bool | None = None) -> Request:
        """An engine Request for one prompt (RequestBuilder.encode, then .request)."""
        return self.requests.request(self.encode(prompt, chat), config)

    def grammar(self, response_format=None, grammar: str | None = None):
        """The compiled grammar for a response_format or grammar string (RequestBuilder.grammar)."""
        return self.requests.grammar(response_format, grammar)

    def generate(self, prompt, *, max_new_tokens: int = 256, sampling: SamplingParams | list | None = None,
                 stop: list[str] | str | None = None, stream: bool = False, chat: bool | None = None,
                 batch_size: int | None = None, lenience: float = 1.0, logprobs: int | None = None,
                 logits_processors=None, response_format=None, grammar: str | None = None,
                 prompt_logprobs: int | None = None, n: int = 1):
        """Generate a continuation whose distribution is exactly the target's (paper §2.3).

        Args:
            prompt: a string, a list of token ids (used verbatim), or a list of either: a batch,
                decoded together through the engine (continuous batching), returning a list of
                results in order.
            max_new_tokens: at most this many new tokens (>= 1), per prompt; 0 with
                prompt_logprobs scores the prompt without generating.
            sampling: SamplingParams (default temperature 1.0; temperature=0 is greedy), or for a
                list of prompts a list of them, one per prompt. Every request has its own
                generator from its own seed, so each result equals the prompt's result alone
                with the same settings.
            stop: a string or list of strings that end the output (excluded from the text).
            stream: return a GenerationStream of TokenEvents instead of the result (one prompt).
            chat: apply the chat template (None: for string prompts when the target has one).
            batch_size: for a list of prompts, how many run at once: None = all, 1 = one after
                another. Each row is what it would be alone (its own γ plan, guard, prompt
                lookup, seed and stops).
            logprobs: None, or N in [0, 20]: result.logprobs (and each TokenEvent.logprob) gives
                every returned token's log-probability under the target's RAW distribution (the
                log-softmax of its logits, before penalties, processors, grammar, temperature,
                top-k, top-p and min-p) and the N most likely alternatives.
            prompt_logprobs: None, or N in [0, 20]: result.prompt_logprobs gives each prompt
                token's log-probability under the target's raw distribution given the tokens
                before it (the first token's entry is None), with the N most likely
                alternatives: a plain forward of the prompt (decoder-only targets).
            n: choices per prompt (1..16): n > 1 returns a list of n results for one prompt (a
                list of such lists for a list of prompts), decoded together as rows of one
                batch; with a seed s, choice i is seeded s + i, so it is the same every time.
            logits_processors: callables with transformers' LogitsProcessor signature,
                processor(input_ids [1, T] int64, scores [1, V] float32) -> scores, applied after
                the penalties, to the target's and the draft's logits at every position with
                that position's whole prefix (prompt + output + drafts before it). A processor
                must be a function of its arguments: it also sees drafted positions that may be
                rejected, and one position more than once (hidden state breaks exactness).
            response_format: OpenAI's {"type": "json_schema", "json_schema": {"schema": {...}}},
                {"type": "json_object"} or {"type": "text"}: the output follows it (a token
                mask on p and q); an output that ends by EOS parses.
            grammar: instead of response_format, an EBNF grammar (GBNF, `root ::= ...`) or
                "regex:PATTERN".
            lenience: l in (0, 1]; 1 (default) is exact. l < 1 is LOSSY (paper A.5): it changes
                the output distribution (no token gets more than p(x)/l; greedy keeps a draft
                token with p(x) >= l·max p) and marks result.stats.lossy.
        Returns:
            GenerationResult (.text, .token_ids, .finish_reason, .stats, .origins), a list of
            them for a batch or n > 1, or a GenerationStream.
        Raises:
            ValueError: bad prompt (any prompt of a batch, before anything is generated),
                max_new_tokens < 1, empty stop string, batch_size not None or >= 1, stream=True
                with a list or n > 1, lenience outside (0, 1] (or < 1 with verification="block"), a list
                of sampling of the wrong length, n outside [1, 16].
            TypeError: an argument of the wrong type (named).
        """
        if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
            raise ValueError(f"batch_size must be None (all at once) or an integer >= 1, got {batch_size!r}")
        if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}] (choices per prompt), got {n!r}")
        is_batch = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (str, list, tuple))
        compiled = self.grammar(response_format, grammar)  # once for every prompt
        extra = {"logprobs": logprobs, "logits_processors": logits_processors, "grammar": compiled,
                 "prompt_logprobs": prompt_logprobs}
        if n > 1:
            if stream:
                raise ValueError("stream=True takes one choice (n=1)")
            prompts = prompt if is_batch else [prompt]
            samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
            if len(samplings) != len(prompts):
                raise ValueError(f"sampling has {len(samplings)} entries for {len(prompts)} prompts; give one per "
                                 "prompt")
            flat = self.generate([p for p in prompts for _ in range(n)], max_new_tokens=max_new_tokens,
                                 sampling=[c for s in samplings for c in choice_samplings(s, n)], stop=stop,
                                 chat=chat, batch_size=batch_size, lenience=lenience, logits_processors=logits_processors,
                                 grammar=compiled, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
            grouped = [flat[i:i + n] for i in range(0, len(flat), n)]
            return grouped if is_batch else grouped[0]
        if not is_batch:
            if isinstance(sampling, (list, tuple)):
                raise TypeError("sampling is a list, but there is one prompt: pass one SamplingParams")
            request = self.request(prompt, self.config(max_new_tokens, sampling, stop, lenience, **extra), chat)
            request_id = self._driver.submit(request, keep_events=stream)
            if stream:
                return GenerationStream(self._driver, request_id)
            return self._driver.result(request_id)
        if stream:
            raise ValueError("stream=True takes one prompt, not a list")
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompt)
        if len(samplings) != len(prompt):
            raise ValueError(f"sampling has {len(samplings)} entries for {len(prompt)} prompts; give one per prompt")
        # Validate every prompt before generating any.
        requests = [self.request(p, self.config(max_new_tokens, s, stop, lenience, **extra), chat)
                    for p, s in zip(prompt, samplings)]
        return self._run_all(requests, batch_size or len(requests))

    def _run_all(self, requests: list[Request], batch_size: int) -> list[GenerationResult]:
        """Keep at most batch_size of these requests in the engine; a new one joins as one finishes."""
        results: list[GenerationResult | None] = [None] * len(requests)

        def finish(index, done, _):
            results[index] = done[0]

        self._driver.decode_all(range(len(requests)), lambda i: ([requests[i]], None), finish, batch_size)
        return results
