"""Every request, from every driver, becomes an engine Request here: the library's arguments
(`SpeculativeDecoder.generate`), a server body and a batch line (both `frontend.schema` models).

One place for: prompt validation and the chat template, sampling parameters from wire fields,
logprobs, response_format/grammar, stops, the target's generation_config defaults, which requests
the guard may pause (paper Cor. 3.9), and an encoder–decoder target's encoder input (paper §4.1).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
import threading
import warnings

from specdecode.config import DecoderConfig
from specdecode.frontend.options import RequestOptions
from specdecode.engine.request import DecodeConfig, Request
from specdecode.frontend.schema import ApiError, ChatRequest, CompletionRequest, \
    max_tokens, num_logprobs, prompt_list, stops
from specdecode.sampling import SamplingParams
from specdecode.sampling_params import OptionError

COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024         # chat has no OpenAI default: the room left, at most this

# generation_config keys that do not shape the output distribution (ids, cache and output plumbing)
_NOT_SAMPLING = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
                 "_from_model_config", "use_cache", "output_attentions", "output_hidden_states", "output_scores",
                 "output_logits", "return_dict_in_generate", "cache_implementation", "cache_config",
                 "return_legacy_cache", "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
                 "assistant_confidence_threshold", "_commit_hash"}
# the ones we apply exactly (on top of the request's own settings)
_APPLIED = ("repetition_penalty", "no_repeat_ngram_size")


def choice_samplings(sampling: SamplingParams | None, n: int) -> list[SamplingParams | None]:
    """The sampling of each of n choices of one request: choice i of a request seeded s is
    seeded s + i (wrapping within [0, 2**64)), so each choice is the same every time and
    choice 0 is the request alone; unseeded choices draw their own seeds."""
    if n == 1 or sampling is None or sampling.seed is None:
        return [sampling] * n
    return [sampling] + [dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**64) for i in range(1, n)]


def generation_defaults(model) -> dict:
    """The model's generation_config values we apply exactly ({name: value}: repetition_penalty,
    no_repeat_ngram_size); warns once about the others that would shape transformers' output."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = {k: v for k, v in config.to_diff_dict().items() if k not in _NOT_SAMPLING}
    applied = {}
    if diff.get("repetition_penalty") not in (None, 1.0):
        applied["repetition_penalty"] = float(diff["repetition_penalty"])
    if diff.get("no_repeat_ngram_size"):
        applied["no_repeat_ngram_size"] = int(diff["no_repeat_ngram_size"])
    ignored = sorted(k for k in diff if k not in _APPLIED)
    if ignored:
        warnings.warn(f"the target's generation_config sets {', '.join(f'{k}={diff[k]!r}' for k in ignored)}: "
                      "not applied (pass them in SamplingParams); applied: "
                      f"{', '.join(f'{k}={v!r}' for k, v in applied.items()) or 'nothing'}", stacklevel=4)
    return applied


@dataclass(frozen=True)
class WireRequest:
    """A server body or batch line as engine work: one Request per completion, prompt-major
    (request i is prompt i // n's choice i % n), each prompt's token ids, and for a completions
    body with `echo` each prompt's text, returned before its choices' texts (None without echo)."""

    requests: list[Request]
    prompt_ids: list[list[int]]
    n: int = 1
    echo: list[str] | None = None

    @property
    def prompt_tokens(self) -> int:
        """usage.prompt_tokens: every prompt counted once."""
        return sum(len(ids) for ids in self.prompt_ids)


class RequestBuilder:
    """Builds validated engine Requests for one loaded target.

    Args:
        tokenizer: the target's.  target: its backend (vocab_size, max_length; an encoder–decoder
            one has decoder_start_token_id).  eos_token_ids: ids that end an output.
        decoder: the decoder's DecoderConfig (gamma_schedule and verification of every request;
            its check_lenience rule).
        num_speculative_tokens: γ_max of every request (the tuned one; a server body may lower it).
        guard_costs: (c, slope[, base]) for requests the guard may pause, or None.
        defaults: the target's generation_config defaults to apply (None: generation_defaults() of
            the target's model where decoder.use_generation_config, else none).
        is_encoder_decoder: the prompt is the encoder's input (paper §4.1).

    Thread-safe: the server builds requests in worker threads while the engine thread runs, so
    give it a tokenizer of its own (not the engine's: a fast tokenizer refuses concurrent use);
    tokenizing and the lazily built grammar compiler are behind one lock.
    """

    def __init__(self, tokenizer, target, eos_token_ids: frozenset[int], *, decoder: DecoderConfig,
                 num_speculative_tokens: int, guard_costs: tuple[float, ...] | None = None,
                 defaults: dict | None = None, is_encoder_decoder: bool = False):
        self.tokenizer, self.target, self.eos_token_ids = tokenizer, target, eos_token_ids
        self.decoder, self.num_speculative_tokens, self.guard_costs = decoder, num_speculative_tokens, guard_costs
        # a GGUF file on llama.cpp has no transformers generation_config: nothing to apply
        self.defaults = defaults if defaults is not None else generation_defaults(getattr(target, "model", None)) \
            if decoder.use_generation_config else {}
        self.is_encoder_decoder = is_encoder_decoder
        self._grammar_compiler = None
        self._lock = threading.RLock()

    @property
    def has_chat_template(self) -> bool:
        return not self.is_encoder_decoder and bool(getattr(self.tokenizer, "chat_template", None))

    # --- prompts ---------------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """[{"role", "content"}, ...] through the target's chat template, ready for the reply.

        Raises:
            ValueError: the target has no chat template (or is an encoder–decoder model).
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: give the prompt as plain text")
        try:
            with self._lock:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        except (UnicodeError, TypeError) as err:  # lone surrogates: the tokenizer's message is internal
            raise ValueError(f"the messages cannot be tokenized ({type(err).__name__}): are they valid Unicode "
                             "text?") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """A string (chat template applied per `chat`: None applies it when the target has one) or
        token ids (verbatim) → validated token ids. For an encoder–decoder target these are the
        encoder's input: a string is tokenized with the tokenizer's special tokens (T5's closing
        </s>) and never gets a chat template.

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, chat=True without a template
                (or with an encoder–decoder target), a prompt that fills the context window,
                text the tokenizer cannot take.
            TypeError: a prompt that is neither a string nor a list of token ids.
        """
        if isinstance(prompt, str) and self.is_encoder_decoder:
            if chat:
                raise ValueError("chat=True: an encoder-decoder target takes its prompt as plain encoder input")
            ids = self._tokenize(prompt, special=True) if prompt else []
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            if chat and not self.has_chat_template:
                raise ValueError("chat=True, but the target's tokenizer has no chat template")
            if chat or (chat is None and self.has_chat_template):
                ids = self.chat_ids([{"role": "user", "content": prompt}])
            else:
                ids = self._tokenize(prompt, special=False)
        elif isinstance(prompt, (list, tuple)):
            try:
                ids = [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d int tensors
            except TypeError:
                raise ValueError("a token-id prompt must be a list of integers, got "
                                 f"{[type(t).__name__ for t in prompt][:5]}") from None
            if any(isinstance(t, bool) for t in prompt):
                raise ValueError("a token-id prompt must be a list of integers, not booleans")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return self.check_ids(ids)

    def _tokenize(self, text: str, special: bool) -> list[int]:
        try:
            with self._lock:
                return self.tokenizer.encode(text, add_special_tokens=special)
        except (ValueError, TypeError) as err:  # e.g. lone surrogates: the tokenizer's own message is internal
            raise ValueError(f"the prompt cannot be tokenized ({type(err).__name__}): is it valid Unicode text?") \
                from None

    def check_ids(self, ids: list[int]) -> list[int]:
        """Raises ValueError for an empty prompt, ids outside the vocabulary or one longer than the
        context (one that fills it exactly can be scored; request() refuses it new tokens)."""
        if not ids:
            raise ValueError("prompt is empty; give at least one character or token id")
        vocab = self.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.target.max_length
        if limit is not None and len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window is {limit} (the target's, or "
                             "max_model_len)")
        return ids

    def request(self, ids: list[int], config: DecodeConfig) -> Request:
        """The engine Request for validated prompt ids: for an encoder–decoder target they are the
        encoder's input and the decoder starts from decoder_start_token_id.

        Raises:
            ValueError: a prompt that fills the context window, with new tokens asked for (it can
                still be scored: max_new_tokens=0 with prompt_logprobs).
        """
        limit = self.target.max_length
        if not self.is_encoder_decoder and limit is not None and len(ids) >= limit and config.max_new_tokens > 0:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window is {limit} (the target's, or "
                             f"max_model_len): no room for "
                             "a new token (max_new_tokens=0 with prompt_logprobs scores it)")
        if self.is_encoder_decoder:
            return Request([self.target.decoder_start_token_id], config, encoder_input_ids=ids)
        return Request(ids, config)

    # --- how to decode ---------------------------------------------------------------------------

    def grammar(self, response_format=None, grammar: str | None = None):
        """The compiled specdecode.grammar.Grammar for a response_format or grammar string (None for neither).

        Raises:
            ValueError: an invalid response_format, schema, regex or grammar (the engine's message).
            ImportError: xgrammar is not installed.
        """
        if response_format is None and grammar is None:
            return None
        if grammar is not None and not isinstance(grammar, str):  # already compiled
            from specdecode.grammar import Grammar

            if not isinstance(grammar, Grammar):
                raise TypeError(f"grammar must be a string (GBNF, or 'regex:PATTERN'), got {type(grammar).__name__}")
            return grammar
        with self._lock:
            if self._grammar_compiler is None:
                from specdecode.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
            return self._grammar_compiler.compile(response_format, grammar)

    def config(self, max_new_tokens: int, sampling: SamplingParams | None = None, stop=None,
               lenience: float = 1.0, logprobs: int | None = None, logits_processors=None,
               response_format=None, grammar=None, prompt_logprobs: int | None = None) -> DecodeConfig:
        """The DecodeConfig of a request with these settings (validated); the target's
        generation_config defaults are applied here. `grammar` may be an already compiled
        specdecode.grammar.Grammar. Arguments as SpeculativeDecoder.generate.

        Raises:
            TypeError, ValueError: RequestOptions.validate's; a logit_bias id outside the
                vocabulary, prompt_logprobs with an encoder–decoder target, a logits processor that
                is not callable, an invalid response_format, schema or grammar.
        """
        options = RequestOptions(max_new_tokens, sampling, stop, lenience, logprobs, prompt_logprobs).validate(
            self.decoder)
        sampling = options.sampling
        vocab = self.target.vocab_size
        if sampling.logit_bias and max(sampling.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids {sorted(t for t in sampling.logit_bias if t >= vocab)[:5]} are "
                             f"outside the vocabulary [0, {vocab})")
        if prompt_logprobs is not None and self.is_encoder_decoder:
            raise ValueError("prompt_logprobs need a decoder-only target (an encoder-decoder model's prompt is "
                             "its encoder's input)")
        processors = list(logits_processors or ())
        if not all(callable(p) for p in processors):
            raise ValueError("logits_processors must be callables processor(input_ids [1, T], scores [1, V]) -> scores")
        from specdecode.grammar import Grammar

        compiled = grammar if isinstance(grammar, Grammar) else self.grammar(response_format, grammar)
        if compiled is not None and (sampling.min_tokens > 0 or sampling.ignore_eos):
            # the grammar ends an output where only EOS may follow: masking EOS then leaves no token
            raise OptionError("min_tokens" if sampling.min_tokens > 0 else "ignore_eos",
                              "min_tokens and ignore_eos cannot be combined with a grammar or response_format "
                              "(the grammar decides where the output ends)")
        if "repetition_penalty" in self.defaults and sampling.repetition_penalty == 1.0:
            sampling = dataclasses.replace(sampling, repetition_penalty=self.defaults["repetition_penalty"])
        if "no_repeat_ngram_size" in self.defaults:
            from transformers import NoRepeatNGramLogitsProcessor

            processors.insert(0, NoRepeatNGramLogitsProcessor(self.defaults["no_repeat_ngram_size"]))
        return DecodeConfig(max_new_tokens=options.max_new_tokens, sampling=sampling,
                            num_speculative_tokens=self.num_speculative_tokens, eos_token_ids=self.eos_token_ids,
                            stop=options.stop, lenience=options.lenience,
                            costs=self.guard_costs if self.guarded(sampling, lenience) else None,
                            gamma_schedule=self.decoder.gamma_schedule, verification=self.decoder.verification,
                            logprobs=options.logprobs, prompt_logprobs=options.prompt_logprobs,
                            logits_processors=tuple(processors), grammar=compiled)

    def for_generate(self, prompt, *, max_new_tokens: int, sampling=None, stop=None, chat: bool | None = None,
                     stream: bool = False, n: int = 1, lenience: float = 1.0, logprobs: int | None = None,
                     logits_processors=None, response_format=None, grammar=None,
                     prompt_logprobs: int | None = None) -> tuple[list[Request], bool]:
        """The Requests of one SpeculativeDecoder.generate call, every one validated before any is
        decoded (arguments as generate's): each prompt n times in a row (choice i of a seeded
        prompt seeded s + i: choice_samplings), the grammar compiled once. Returns (requests,
        whether `prompt` was a list of prompts).

        Raises:
            ValueError, TypeError: as generate's (any prompt of a list, before anything runs).
        """
        RequestOptions(n=n).validate()
        is_batch = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (str, list, tuple))
        if stream and (is_batch or n > 1):
            raise ValueError("stream=True takes one prompt, not a list" if is_batch else
                             "stream=True takes one choice (n=1)")
        prompts = prompt if is_batch else [prompt]
        if isinstance(sampling, (list, tuple)):
            if not is_batch:
                raise TypeError("sampling is a list, but there is one prompt: pass one SamplingParams")
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts; give one per "
                                 "prompt")
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        compiled = self.grammar(response_format, grammar)
        requests = []
        for one, s in zip(prompts, samplings):
            configs = [self.config(max_new_tokens, choice, stop, lenience, logprobs, logits_processors,
                                   grammar=compiled, prompt_logprobs=prompt_logprobs)
                       for choice in choice_samplings(s, n)]
            ids = self.encode(one, chat)
            requests.extend(self.request(ids, config) for config in configs)
        return requests, is_batch

    def guarded(self, sampling: SamplingParams, lenience: float) -> bool:
        """Whether the guard may pause this request's drafting. A seeded sampled request must give
        the same output alone, in a batch and in another process (which measures its own c): not
        guarded under the paper's rule, whose random numbers follow the drafts; guarded under
        drafter-invariant verification, whose tokens do not. Exact greedy output does not depend on
        when drafting pauses (up to bf16 near-ties); lenient greedy does (a paused step emits the
        argmax): not guarded either."""
        if sampling.greedy:
            return lenience == 1
        return sampling.seed is None or self.decoder.verification == "drafter-invariant"

    # --- wire bodies -----------------------------------------------------------------------------

    def from_wire(self, req: ChatRequest | CompletionRequest, template: bool | None = False) -> WireRequest:
        """The engine work of a validated server body or batch line (WireRequest: a Request per
        completion, prompts × n; each prompt's ids; the echoed prompts).

        template: for a completions body with a string prompt, send it through the chat template
            as one user message (None: when the target has one; the batch job's `prompt` lines).
            A chat body always goes through the template.
        `echo` with `logprobs` asks for the prompt's logprobs (DecodeConfig.prompt_logprobs);
        `max_tokens: 0` with `echo` scores the prompt without generating.
        Raises:
            ApiError: 400 naming the field for a prompt the model cannot take (empty, ids outside
                the vocabulary, too long with max_tokens, no chat template), sampling values out
                of range or an invalid response_format/grammar.
        """
        chat = isinstance(req, ChatRequest)
        prompts = [None] if chat else prompt_list(req)
        all_ids = []
        for i, prompt in enumerate(prompts):
            param = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{i}"
            try:
                all_ids.append(self.check_ids(self.chat_ids([{"role": m.role, "content": m.text()}
                                                             for m in req.messages])) if chat else
                               self.encode(prompt, chat=template if isinstance(prompt, str) else None))
            except (ValueError, TypeError) as err:
                raise ApiError(400, str(err).splitlines()[0] if str(err) else "the prompt cannot be tokenized",
                               param) from None
        longest = max(len(ids) for ids in all_ids)
        limit = self.target.max_length
        room = limit - longest if limit is not None else None
        default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if chat and room is not None:
            default = min(default, room)
        max_new = max_tokens(req, default)
        if room is not None and max_new > room:
            field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"the prompt has {longest} tokens and {field} is {max_new}: more than the model's "
                                f"context of {limit} tokens", field)
        outside = sorted(int(k) for k in req.logit_bias or {} if int(k) >= self.target.vocab_size)
        if outside:
            raise ApiError(400, f"logit_bias token ids {outside[:5]} are outside the vocabulary "
                                f"[0, {self.target.vocab_size})", "logit_bias")
        if (req.min_tokens or 0) > max_new:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_new})", "min_tokens")
        echo = not chat and bool(req.echo)
        if echo and self.is_encoder_decoder:
            raise ApiError(400, "echo needs a decoder-only target", "echo")
        # echo: the prompt's logprobs when logprobs are asked (a score-only row when max_tokens is 0)
        prompt_logprobs = num_logprobs(req) if echo else None
        if max_new == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        try:
            sampling = self.wire_sampling(req)
        except (ValueError, TypeError) as err:  # SamplingParams' rules (OptionError names the field)
            raise ApiError(400, str(err), getattr(err, "field", None)) from None
        field = "grammar" if req.grammar is not None else "response_format"
        try:
            grammar = self.grammar(req.response_format, req.grammar)
        except (ValueError, ImportError) as err:
            raise ApiError(400, f"{field}: {err}", field) from None
        try:
            config = self.config(max_new, sampling, stops(req), logprobs=num_logprobs(req), grammar=grammar,
                                 prompt_logprobs=prompt_logprobs)
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err), getattr(err, "field", None)) from None
        if req.num_speculative_tokens is not None:
            config = dataclasses.replace(config, num_speculative_tokens=req.num_speculative_tokens)
        n = req.n or 1
        requests = [self.request(ids, dataclasses.replace(config, sampling=s))
                    for ids in all_ids for s in choice_samplings(config.sampling, n)]
        echoed = None
        if echo:
            with self._lock:
                echoed = [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(prompts, all_ids)]
        return WireRequest(requests, all_ids, n, echoed)

    @staticmethod
    def wire_sampling(req: ChatRequest | CompletionRequest) -> SamplingParams:
        """The one mapping of wire fields to SamplingParams (OpenAI's defaults where a field is absent)."""
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0, seed=req.seed,
                              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                              presence_penalty=req.presence_penalty or 0.0,
                              frequency_penalty=req.frequency_penalty or 0.0,
                              logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()} or None,
                              min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos))
