"""Token ids → text, incrementally, and stop strings that may span tokens (docs/exactness.md rule 4)."""

from __future__ import annotations

# Prompt tokens decoded in front of the output, so that tokenizers which drop a leading space
# at the start of a decode (SentencePiece) render the first new token the way it reads in context.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes one token at a time without broken UTF-8 or merged-space artefacts.

    A byte-level token can end in the middle of a multi-byte character; its text is held back
    (decode gives U+FFFD) until the character is complete. Each step decodes only a short window,
    so the cost per token does not grow with the output.

    Args:
        tokenizer: a transformers tokenizer.  prompt_ids: the prompt, for context.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character renders as U+FFFD)."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):]


class StopStrings:
    """Finds stop strings in streamed text and holds back what could be the start of one.

    push(delta) returns (text safe to emit, stopped). Once a stop string appears, the text up to
    it (excluded) is emitted and nothing after it, even when it spans several tokens.
    """

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        text = self.held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = self._partial_match(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def _partial_match(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
