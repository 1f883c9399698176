"""SpeculativeDecoder: the public entry point, a thin facade. It checks its arguments and puts the
layers together: the models (specdecode.models.pair), the proposer (specdecode.proposers), the
request path (specdecode.frontend.builder) and the engine with its driver (specdecode.engine)."""

from __future__ import annotations

import copy
import os
import weakref
from typing import Callable, Iterator

from specdecode.engine.driver import Driver
from specdecode.engine.engine import Engine
from specdecode.engine.request import VERIFICATIONS, DecodeConfig, GenerationResult, Request, TokenEvent
from specdecode.frontend.builder import RequestBuilder, choice_samplings, generation_defaults, is_int as _is_int
from specdecode.frontend.schema import MAX_CHOICES
from specdecode.measure.hardware import cpu_report
from specdecode.measure.timing import guard_costs as measure_guard_costs
from specdecode.models.loading import eos_token_ids, load_tokenizer
from specdecode.models.pair import QUANTIZATIONS, Pair
from specdecode.proposers import CrossVocabProposer, build_proposer
from specdecode.proposers.cross_vocab import METHODS as CROSS_VOCAB_METHODS
from specdecode.sampling import SamplingParams

# Defaults, exact, chosen on HumanEval: free drafts first (suffix drafts since they measured
# 1.01-1.17x n-gram prompt lookup, docs/suffix_drafts.md); otherwise the draft, with int4
# weights and eager attention, scoring only the first 32768 ids, drafts up to 8 tokens, stopping
# once it is less than 40% sure of its own token. Fixed γ ≤ 8 beat the adaptive schedule on the
# 20-prompt set (docs/bench_code_t0_fixed_gamma8.md 2.26x vs docs/bench_code_t0.md 2.07x) and
# tied it on 5 held-out prompts once the guard's estimator was fixed; confidence 0.4 beat 0.2 and
# int4 tied int8 there (docs/tune_draft.md) with a cheaper draft step (c 0.12 vs 0.19).
DEFAULT_GAMMA = 8
DEFAULT_DRAFT_CONFIDENCE = 0.4
DEFAULT_GAMMA_SCHEDULE = "fixed"
# Token-wise: block verification keeps more drafts in expectation, but on 20 HumanEval prompts at
# temperature 1 it measured 2.59x against 2.61x (docs/bench_code_t1_20.md), within noise.
DEFAULT_VERIFICATION = "token"


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
        self.result = yield from self._driver.stream(self._request_id)
        self._finalizer.detach()

    def close(self) -> None:
        """Abort the request if it has not finished (its row leaves the batch)."""
        if self.result is None:
            self._finalizer.detach()
            self._driver.abort(self._request_id)


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
        num_speculative_tokens: γ, the most drafts per target call (>= 1; default 8). With
            dtype="auto" the measured choice may lower it (Eq. 1 with this machine's r(k)).
        draft_confidence: stop drafting early once the draft's probability of its own token is
            below this (dynamic γ, exact; default 0.4); 0 always drafts γ tokens.
        draft_vocab_limit: the draft scores only token ids below this (a cheaper LM head; exact,
            since q is zero elsewhere); None scores the whole vocabulary; "auto" (default) uses
            the zoo's measured limit for zoo drafts and None for others.
        prompt_lookup: free drafts first, the draft model serving the other steps. True or
            "suffix": suffix drafts (specdecode.proposers.suffix: the most frequent continuation
            of the longest match of the row's last tokens in its prompt and output and in earlier
            requests' outputs; measured faster than "ngram" in docs/suffix_drafts.md); "ngram":
            prompt lookup (paper §3.6: what followed the latest match of the last 2-3 tokens in
            the row's own tokens); False: none. None (default): suffix drafts when there is a
            draft model. With draft=None and prompt_lookup set, free drafts are the only
            proposer; draft=None alone is plain decoding.
        draft_tokenizer: the draft's tokenizer (an object, or a name or path to load) where it is
            not the target's: a draft given as a model object otherwise gets the target's, one
            loaded by name or path its own. A draft whose tokenizer differs from the target's
            proposes through the token strings both vocabularies hold (exact: TLI for sampled
            requests, SLEM for greedy ones; specdecode.proposers.cross_vocab).
        cross_vocab: for such a draft, "auto" (the rule above), "tli" or "slem" for every request.
        quantize_draft: "int8" (per-row scales) or "int4" (groups of 32 with scale and zero):
            store the draft's linear layers as integers, weight-only, for a cheaper draft step;
            still exact, since only the proposal changes (paper §3.6). "none" or False keeps its
            weights; True means the default kind (DEFAULT_DRAFT_QUANTIZATION). None (default):
            the default kind for a draft loaded by name or path on the CPU, none for a draft
            given as a loaded model (a kind or True quantizes a copy of it; the user's object is
            never changed), for encoder–decoder drafts (their layers read .weight directly) and
            on other devices (the int kernels are CPU kernels); asking for a kind there raises.
        gamma_schedule: "fixed" drafts up to γ every step; "adaptive" starts at 4, adds 2 after a
            fully accepted block and drops 1 otherwise, within [1, γ] (transformers' "heuristic"
            schedule). Exact either way (the choice looks only at the past).
        verification: "token" (default) verifies drafts one by one (paper §2.3); "block" verifies
            each drafted block jointly (Sun et al. 2024, specdecode.verify.block_step): exact too,
            never fewer accepted drafts in expectation, the same output under greedy decoding.
            Lenience < 1 (lossy) needs "token".
        tree_width: with a draft model, draft a token tree (SpecInfer/Sequoia style): at each
            position where the draft is less than tree_confidence sure of its token, up to
            tree_width − 1 sibling candidates (sampled without replacement, or the next-best
            tokens when greedy), all scored in the same target call and verified exactly
            (specdecode.verify.tree_step). 1 (default) drafts a chain. Needs verification="token"
            and lenience 1.
        tree_confidence: in (0, 1], where to branch (default 0.8).
        guard: pause drafting while the request's acceptances say it does not pay (Cor. 3.9's
            α > c checked at run time, specdecode.engine.guard), probing again every 16 steps;
            and, with two or more such requests running, pause them on steps where the loop's
            own timings say a plain step serves the batch better (specdecode.engine.cost).
            Exact either way. Seeded sampled requests are not guarded, so that a seed gives the
            same output alone, in a batch and in another process. Default True.
        guard_costs: (c, slope) for the guard: c = a draft forward's time over a target step's,
            slope = (r(γ+1) − 1) / γ, the extra cost of each verified draft in target steps. None
            (default) measures both once here (a few forwards of each model, ~3 s on the zoo pair).
        dtype: "auto" (default, also None): for models loaded by name or path on the CPU (target
            of 100 M parameters or more), time the target in bfloat16 (two ways) and float32 with
            packed weights, and the draft's kernels and dtypes, once per machine and pair (cached
            in ~/.cache/specdecode/choices), and run the fastest by Eq. 1 with the measured r(k)
            (specdecode.measure.autoconfig; plain decoding, without the draft, where nothing beats
            it); see configuration(). Elsewhere bfloat16. "bfloat16", "float32" or "float16" are
            used as given (a float32 Llama/Qwen2 target gets oneDNN-packed weights: the same
            float32 products).
        device: None (where a model given as an object already is, else "cpu"), "cpu", "cuda",
            "cuda:N" or "mps". Models are moved there (a model given as an object too).
        device_map: a target too big for one device: passed to transformers' from_pretrained
            ("auto", "balanced", "sequential" or a {module name: device} dict; accelerate places the
            layers on GPUs, the CPU, or offloads them), for a target loaded by name or path. The
            draft then goes to the device of the target's input embeddings (its first device),
            and logits are gathered there. None (default): the whole target on `device`.
        offload_folder: with a device_map that puts layers on "disk": where accelerate keeps them.
        max_batch_size: the most requests decoded together (None: no limit; generate's
            batch_size can lower it per call).
        use_generation_config: apply the target's own generation_config defaults that we can
            apply exactly: its repetition_penalty (to requests whose own is 1.0) and
            no_repeat_ngram_size (transformers' NoRepeatNGramLogitsProcessor). Any other value
            that would shape transformers' output (temperature, top_k, top_p, do_sample, ...) is
            NOT applied (SamplingParams stay explicit): a warning names them once, at load.
            False ignores the generation_config. Default True.
        progress: called with one-line messages while models are assembled and loaded.
    Raises:
        ValueError: unknown model, tokenizers that differ, an encoder–decoder model paired with a
            decoder-only one, draft_vocab_limit on an encoder–decoder draft, γ < 1, unknown dtype,
            an unknown verification, tree_width < 1, tree_confidence outside (0, 1], a tree with
            verification="block" or an encoder–decoder or sliding-window target, a device that is
            not available, quantize_draft off the CPU or on a float64 draft, device_map with
            `device` or with a target given as a loaded model.
        FileNotFoundError: the default pair's part packages are not installed.
    """

    def __init__(self, target="default", draft="default", *, tokenizer=None,
                 num_speculative_tokens: int = DEFAULT_GAMMA, draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE,
                 draft_vocab_limit: int | str | None = "auto", prompt_lookup: bool | str | None = None,
                 quantize_draft: bool | str | None = None, gamma_schedule: str = DEFAULT_GAMMA_SCHEDULE,
                 verification: str = DEFAULT_VERIFICATION, tree_width: int = 1, tree_confidence: float = 0.8,
                 guard: bool = True, guard_costs: tuple[float, float] | None = None, dtype=None, device=None,
                 device_map=None, offload_folder: str | None = None, max_batch_size: int | None = None,
                 progress: Callable[[str], None] | None = None, use_generation_config: bool = True,
                 draft_tokenizer=None, cross_vocab: str = "auto"):
        if not _is_int(num_speculative_tokens) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens (γ) must be an integer >= 1, got {num_speculative_tokens!r}")
        if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, (int, float)) \
                or not 0 <= draft_confidence < 1:
            raise ValueError(f"draft_confidence must be in [0, 1), got {draft_confidence!r}")
        if gamma_schedule not in ("fixed", "adaptive"):
            raise ValueError(f"gamma_schedule must be 'fixed' or 'adaptive', got {gamma_schedule!r}")
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {', '.join(map(repr, VERIFICATIONS))}, got {verification!r}")
        if not _is_int(tree_width) or tree_width < 1:
            raise ValueError(f"tree_width must be an integer >= 1 (1 = a chain), got {tree_width!r}")
        if isinstance(tree_confidence, bool) or not isinstance(tree_confidence, (int, float)) \
                or not 0 < tree_confidence <= 1:
            raise ValueError(f"tree_confidence must be in (0, 1], got {tree_confidence!r}")
        if tree_width > 1 and verification != "token":
            raise ValueError("token trees are verified by their own rule: tree_width > 1 needs verification='token'")
        if guard_costs is not None and (len(guard_costs) != 2 or not all(x >= 0 for x in guard_costs)):
            raise ValueError(f"guard_costs must be two numbers >= 0 (c, slope), got {guard_costs!r}")
        if not (quantize_draft is None or isinstance(quantize_draft, bool) or quantize_draft in QUANTIZATIONS):
            raise ValueError(f"quantize_draft must be one of {', '.join(QUANTIZATIONS)}, True, False or None, "
                             f"got {quantize_draft!r}")
        if draft_vocab_limit not in (None, "auto") and (not _is_int(draft_vocab_limit) or draft_vocab_limit < 1):
            raise ValueError(f"draft_vocab_limit must be a positive integer, 'auto' or None, got {draft_vocab_limit!r}")
        if cross_vocab not in CROSS_VOCAB_METHODS:
            raise ValueError(f"cross_vocab must be one of {', '.join(CROSS_VOCAB_METHODS)}, got {cross_vocab!r}")
        if isinstance(draft_tokenizer, (str, os.PathLike)):
            draft_tokenizer = load_tokenizer(draft_tokenizer)
        if prompt_lookup not in (None, True, False, "ngram", "suffix"):
            raise ValueError(f"prompt_lookup must be None, True, False, 'ngram' or 'suffix', got {prompt_lookup!r}")
        if max_batch_size is not None and (not _is_int(max_batch_size) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or an integer >= 1, got {max_batch_size!r}")
        self.draft_confidence = draft_confidence
        self.gamma_schedule = gamma_schedule
        self.verification = verification
        self.tree_width, self.tree_confidence = tree_width, tree_confidence
        self.pair = Pair(target, draft, tokenizer=tokenizer, dtype=dtype, device=device, device_map=device_map,
                         offload_folder=offload_folder, quantize_draft=quantize_draft,
                         draft_vocab_limit=draft_vocab_limit, num_speculative_tokens=num_speculative_tokens,
                         prompt_lookup=prompt_lookup, tree_width=tree_width, progress=progress,
                         draft_tokenizer=draft_tokenizer)
        self.cross_vocab = cross_vocab if self.pair.cross_vocab else None
        self.target, self.draft, self.tokenizer = self.pair.target, self.pair.draft, self.pair.tokenizer
        self.dtype, self.draft_dtype, self.device, self.choice = (self.pair.dtype, self.pair.draft_dtype,
                                                                  self.pair.device, self.pair.choice)
        self.is_encoder_decoder = self.pair.is_encoder_decoder
        self.num_speculative_tokens, self.prompt_lookup = self.pair.num_speculative_tokens, self.pair.prompt_lookup
        self.eos_token_ids = eos_token_ids(self.target.backend.model, self.tokenizer)
        self.generation_defaults = generation_defaults(self.target.backend.model) if use_generation_config else {}
        self.guard_costs = None  # None: no guard
        if guard and self.draft is not None:
            if guard_costs is None and progress:
                progress("measuring c (draft step / target step) and the verify cost r(γ+1) for the guard")
            self.guard_costs = guard_costs or measure_guard_costs(self.target.backend, self.draft.backend,
                                                                  self.num_speculative_tokens, self.is_encoder_decoder)
        # the request path's own tokenizer: requests are built in other threads than the engine's
        self.requests = RequestBuilder(copy.deepcopy(self.tokenizer), self.target.backend, self.eos_token_ids,
                                       num_speculative_tokens=self.num_speculative_tokens,
                                       gamma_schedule=gamma_schedule, verification=verification,
                                       tree_width=tree_width, guard_costs=self.guard_costs,
                                       defaults=self.generation_defaults, is_encoder_decoder=self.is_encoder_decoder)
        self.engine = Engine(self.target.backend, self.proposer(), self.tokenizer, max_batch_size,
                             batch_guard=self.guard_costs is not None, first_step_plain=True)
        self._driver = Driver(self.engine)

    def configuration(self) -> dict:
        """What runs, for reports (`generate --json`, the server's /v1/models, `bench`): {"dtype":
        the target's dtype, "target_kernel", "draft_dtype" (the draft's: any dtype keeps the output
        exact), "num_speculative_tokens": γ_max, "machine": this CPU
        (specdecode.measure.hardware.cpu_report), "choice": why dtype="auto" chose it (None when
        the dtype was given, the target was a model object, or it was too small to time)}."""
        choice = self.choice
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "target_kernel": choice.target_kernel if choice else str(self.dtype).removeprefix("torch."),
                "draft_dtype": str(self.draft_dtype).removeprefix("torch.") if self.draft is not None else None,
                "num_speculative_tokens": self.num_speculative_tokens if self.draft is not None or self.prompt_lookup
                else 0,
                "machine": cpu_report(),
                "choice": None if choice is None else {"summary": choice.describe(), "measured": list(choice.notes)},
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
        proposer = build_proposer(draft_backend, self.target.backend.vocab_size, prompt_lookup=self.prompt_lookup,
                                  confidence=self.draft_confidence, tokenizers=tokenizers,
                                  cross_vocab=self.cross_vocab or "auto",
                                  tree_width=self.tree_width if tree_width is None else tree_width,
                                  tree_confidence=self.tree_confidence)
        node = proposer
        while node is not None and not isinstance(node, CrossVocabProposer):  # behind free drafts
            node = getattr(node, "fallback", None)
        if node is not None:
            self.num_shared_tokens = node.num_shared
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
