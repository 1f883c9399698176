"""Step 4's token-by-token commit for one request: EOS, stop strings, max_new_tokens (docs/exactness.md
rule 4). Nothing after a stop is returned, streamed or counted."""

from __future__ import annotations

from specdecode.engine.request import DecodeConfig, TokenEvent, TokenLogprob
from specdecode.engine.text import IncrementalDetokenizer, StopStrings


class Output:
    """The tokens and text a request has emitted, and why it finished (None while running).

    Args:
        config: the request's limits and stops.  tokenizer: for text and stop strings; None
            decodes ids only (text is "").  prompt_ids: the prompt, for the detokenizer's context.
    """

    def __init__(self, config: DecodeConfig, tokenizer, prompt_ids: list[int]):
        self.config = config
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stops = StopStrings(list(config.stop)) if config.stop else None
        self.token_ids: list[int] = []
        self.origins: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self.text_parts: list[str] = []
        self.text_offsets: list[int] = []  # per token: where its text starts, in characters
        self._decoded = 0                  # characters the tokens have decoded to (stops not cut)
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def push(self, token_id: int, origin: str, logprob: TokenLogprob | None = None) -> TokenEvent:
        """Emit one token; sets finish_reason when it ends the output."""
        self.token_ids.append(token_id)
        self.origins.append(origin)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        is_eos = token_id in self.config.eos_token_ids and not self.config.sampling.ignore_eos
        text = self.detok.push(token_id) if self.detok is not None and not is_eos else ""
        offset = self._decoded
        self.text_offsets.append(offset)
        self._decoded += len(text)
        if is_eos:
            self.finish_reason = "eos"
        if self.stops is not None:
            text, stopped = self.stops.push(text)
            if stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.token_ids) >= self.config.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason in ("eos", "length"):
            text += self._flush()
        self.text_parts.append(text)
        return TokenEvent(token_id, text, origin, logprob, offset)

    def finish(self, reason: str) -> str:
        """End the output from outside (context full, abort); returns the text held back."""
        self.finish_reason = reason
        text = self._flush() if reason == "length" else ""
        self.text_parts.append(text)
        return text

    @property
    def num_returned_tokens(self) -> int:
        """How many of token_ids a response lists (logprobs): after a stop, the tokens whose text
        starts before the cut (one in which the stop begins counts: part of its text is
        returned); otherwise all, an EOS that ended the output included (it adds no text; listed
        as OpenAI's and vLLM's servers do, so `max_tokens: 1` always lists one token)."""
        if self.finish_reason == "stop":
            return sum(offset < len(self.text) for offset in self.text_offsets)
        return len(self.token_ids)

    def _flush(self) -> str:
        text = self.detok.flush() if self.detok is not None else ""
        if self.stops is not None:
            text, _ = self.stops.push(text)
            text += self.stops.flush()
        return text


class HeldTokens:
    """A stream's token events held until their text starts reaching the caller: a possible stop
    string holds text back, and if a stop then cuts the output before a token, that token is past
    the cut (not listed, no logprob), as GenerationResult.num_returned_tokens says. The library's
    stream and the server's logprobs both release tokens by this rule."""

    def __init__(self):
        self.held: list[TokenEvent] = []
        self.released_chars = 0  # characters of text passed on
        self.released = 0        # events passed on

    def push(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """Hold `events`; return the held ones whose text has started reaching the caller."""
        self.held.extend(events)
        self.released_chars += sum(len(e.text) for e in events)
        ready = next((i for i, e in enumerate(self.held) if e.text_offset >= self.released_chars), len(self.held))
        return self._release(ready)

    def finish(self, num_returned_tokens: int) -> tuple[list[TokenEvent], list[TokenEvent]]:
        """At the end: (the held events in the output, those past a stop's cut)."""
        kept = self._release(num_returned_tokens - self.released)
        past, self.held = self.held, []
        return kept, past

    def _release(self, count: int) -> list[TokenEvent]:
        out, self.held[:count] = self.held[:count], []
        self.released += len(out)
        return out
