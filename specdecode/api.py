"""SpeculativeDecoder: the public entry point. It builds the layers (the plan: specdecode.tune; the
models: specdecode.models.pair; the proposer: specdecode.proposers; the request path:
specdecode.frontend.builder; the engine and its driver: specdecode.engine) and generates."""

from __future__ import annotations

import copy
from typing import Callable

from specdecode import proposers, tune
from specdecode.config import DecoderConfig
from specdecode.engine.driver import Driver
from specdecode.engine.engine import Engine
from specdecode.engine.stream import GenerationStream
from specdecode.frontend.builder import RequestBuilder
from specdecode.frontend.options import is_int
from specdecode.models.loading import load_tokenizer
from specdecode.models.pair import Pair, check_specs
from specdecode.progress import default as default_progress
from specdecode.sampling import SamplingParams
from specdecode.tune.report import configuration, starting_guard_costs


class SpeculativeDecoder:
    """Exact speculative decoding of a target model with a draft model (paper Algorithm 1).

    Args:
        target: "default" (the zoo pair's target), a zoo name, a local directory, a GGUF file
            (torch dequantizes it; llama.cpp runs it: docs/llamacpp.md), a hub id, or a loaded
            transformers PreTrainedModel (then `tokenizer` is required).
        draft: the same forms, or None for plain decoding. An encoder–decoder target
            (config.is_encoder_decoder: T5, flan-t5, BART; paper §4.1) needs an encoder–decoder draft.
        tokenizer: the tokenizer for a target given as a loaded model.
        progress: called with one-line messages while models are assembled, timed and loaded;
            None (default) logs them on the "specdecode" logger (specdecode.progress).
        **options: any other field of specdecode.config.DecoderConfig, which documents each; old
            spellings still work with a DeprecationWarning (DecoderConfig.from_options).
    Attributes:
        decoder_config: the validated DecoderConfig.  plan: what specdecode.tune chose to load
            (.choice: what dtype="auto" measured, or None).  pair: the loaded models (.target,
            .draft, .tokenizer, .dtype, .is_encoder_decoder, also as target, draft, tokenizer).
        num_speculative_tokens: the planned γ_max.  guard_costs: the guard's starting costs or
            None.  requests: the request path (RequestBuilder).  engine, driver: the loop.
    Raises:
        TypeError: an unknown option.
        ValueError: an option out of range or two that clash (DecoderConfig.validate), an unknown
            model, tokenizers that differ where a draft of another vocabulary cannot work, an
            encoder–decoder model paired with a decoder-only one, an unavailable device.
        FileNotFoundError: the default pair's part packages are not installed.
        ImportError: the llama.cpp backend asked for without llama-cpp-python installed.
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
        self.num_speculative_tokens, self.eos_token_ids = self.plan.gamma, self.pair.eos_token_ids
        self.guard_costs = starting_guard_costs(config, self.plan, self.pair, progress)
        # the request path's own tokenizer: requests are built in other threads than the engine's
        self.requests = RequestBuilder(copy.deepcopy(self.tokenizer), self.target.backend, self.eos_token_ids,
                                       decoder=config, num_speculative_tokens=self.num_speculative_tokens,
                                       guard_costs=self.guard_costs, is_encoder_decoder=self.pair.is_encoder_decoder)
        self.engine = Engine(self.target.backend, proposers.for_pair(self.pair, config, self.plan.free_drafts),
                             self.tokenizer, config.max_batch_size,
                             batch_guard=self.guard_costs is not None and self.draft is not None,
                             first_step_plain=True)
        self.driver = Driver(self.engine)

    def configuration(self) -> dict:
        """What runs and why (specdecode.tune.report.configuration documents each key)."""
        return configuration(self.decoder_config, self.plan, self.pair, self.engine.proposer)

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
                generator from its own seed, so each result equals the prompt's result alone.
            stop: a string or list of strings that end the output (excluded from the text).
            stream: return a GenerationStream of TokenEvents instead of the result (one prompt).
            chat: apply the chat template (None: for string prompts when the target has one).
            batch_size: for a list of prompts, how many run at once: None = all, 1 = one after
                another. Each row is what it would be alone (its own γ plan, guard, seed, stops).
            logprobs: None, or N in [0, 20]: each returned token's log-probability under the
                target's RAW distribution (log-softmax of its logits, before penalties,
                processors, grammar, temperature, top-k/p, min-p) and the N most likely others.
            prompt_logprobs: None, or N in [0, 20]: each prompt token's log-probability under the
                target's raw distribution given the tokens before it (the first's is None).
            n: choices per prompt (1..16), decoded together as rows of one batch: a list of n
                results (a list of such lists for a list of prompts); with a seed s, choice i
                is seeded s + i.
            logits_processors: transformers LogitsProcessors, processor(input_ids [1, T] int64,
                scores [1, V] float32) -> scores, after the penalties, on the target's and the
                draft's logits at every position, drafted ones too (so a function of its arguments).
            response_format: OpenAI's ({"type": "json_schema" | "json_object" | "text", ...}), or
                grammar: a GBNF grammar (`root ::= ...`) or "regex:PATTERN": the output follows it.
            lenience: l in (0, 1]; 1 (default) is exact. l < 1 is LOSSY (paper A.5): no token
                gets more than p(x)/l; it marks result.stats.lossy.
        Returns:
            GenerationResult (.text, .token_ids, .finish_reason, .stats, .origins), a list of
            them for a batch or n > 1, or a GenerationStream.
        Raises:
            ValueError: bad prompt (any prompt of a batch, before anything is generated), an
                argument out of range (RequestBuilder.config, .for_generate), stream=True with a
                list or n > 1, batch_size neither None nor >= 1.
            TypeError: an argument of the wrong type (named).
        """
        if batch_size is not None and (not is_int(batch_size) or batch_size < 1):
            raise ValueError(f"batch_size must be None (all at once) or an integer >= 1, got {batch_size!r}")
        requests, is_batch = self.requests.for_generate(
            prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat, stream=stream, n=n,
            lenience=lenience, logprobs=logprobs, logits_processors=logits_processors,
            response_format=response_format, grammar=grammar, prompt_logprobs=prompt_logprobs)
        if not is_batch and n == 1:
            request_id = self.driver.submit(requests[0], keep_events=stream)
            return GenerationStream(self.driver, request_id) if stream else self.driver.result(request_id)
        results = self.driver.run_all(requests, batch_size or len(requests))
        if n == 1:
            return results
        grouped = [results[i:i + n] for i in range(0, len(results), n)]
        return grouped if is_batch else grouped[0]
