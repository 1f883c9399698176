"""Grammar-constrained output: JSON schema, any JSON, a regex or an EBNF grammar, as a token mask
on p and q (docs/exactness.md rule 9), with xgrammar as the engine.

Why xgrammar (benchmarks/grammar_mask_cost.py, Qwen tokenizer, this CPU): its next-token mask
took a median of ~4 µs per token against llguidance's ~12 µs, and building the tokenizer and
compiling a schema ~0.6 s against ~4.6 s; both are far below one target forward (~100 ms), but
xgrammar also reads regexes and EBNF directly and rolls a matcher back by a token count.

A `GrammarState` is one request's matcher. It consumes the committed output tokens for good
(they never change) and walks each call's drafts temporarily, rolling them back before it
returns, so nothing from a rejected draft stays in the matcher.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

import torch

ENDED = -1  # GrammarState.forced after the stop token

# "[08:31:52] /project/cpp/json_schema_converter.cc:5082: Unsupported type" → "Unsupported type"
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def _short(err: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(err)).strip()
    return (text.splitlines() or ["invalid grammar"])[0][:300]


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("grammar-constrained output needs xgrammar: pip install 'specdecode[grammar]'") from None
    return xgrammar


def parse_response_format(response_format) -> tuple[str, object] | None:
    """An OpenAI `response_format` → (kind, spec), kind in "json_schema" | "json_object"; None for
    {"type": "text"} or None.

    Raises:
        ValueError: not one of {"type": "text" | "json_object" | "json_schema", ...}, or a
            json_schema without a `schema` object (booleans included).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError('response_format must be {"type": "text" | "json_object" | "json_schema", ...}, got '
                         f"{str(response_format)[:100]}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, None
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise ValueError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
    return kind, schema


# JSON-schema keywords the grammar engine (xgrammar) accepts but does not enforce: measured, text
# that violates each passed its matcher (e.g. "1" under {"type": "integer", "not": {"const": 1}}).
# Refused rather than ignored: they change which outputs are valid.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
                       "dependentSchemas", "uniqueItems")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # their keys are names, not keywords
_DATA = ("enum", "const", "default", "examples")                         # values, not schemas


def unenforced_keywords(schema) -> list[str]:
    """The keywords of a JSON schema that the grammar engine would ignore (sorted, with a
    non-local $ref and a multipleOf on a non-integer type among them)."""
    found = set()

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS:
                found.add(key)
            elif key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                found.add(f"$ref to {value}")
            elif key == "multipleOf" and node.get("type") != "integer":
                found.add("multipleOf (on a non-integer)")
            if key in _NAME_MAPS and isinstance(value, dict):
                for sub in value.values():
                    walk(sub)
            elif key not in _DATA:
                walk(value)

    walk(schema)
    return sorted(found)


class Grammar:
    """A compiled grammar (immutable, shared by requests); `state(prompt_len)` gives a request its matcher."""

    def __init__(self, compiled, description: str, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        self.compiled, self.description, self.vocab_size = compiled, description, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def state(self, prompt_len: int) -> "GrammarState":
        return GrammarState(self, prompt_len)

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


class GrammarCompiler:
    """Compiles grammars for one tokenizer (built once per decoder; compiling is cached by xgrammar).

    Args:
        tokenizer: a transformers tokenizer.  vocab_size: V of the target's logits (ids past the
            tokenizer are never allowed).  eos_token_ids: the tokens that may end a complete output.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)

    @classmethod
    def from_vocabulary(cls, tokens: Sequence[str], eos_token_ids: Sequence[int]) -> "GrammarCompiler":
        """For table models in tests: token i is the literal string tokens[i]."""
        xgr = _xgrammar()
        self = cls.__new__(cls)
        info = xgr.TokenizerInfo(list(tokens), xgr.VocabType.RAW, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size, self.eos_token_ids = len(tokens), tuple(eos_token_ids)
        return self

    def compile(self, response_format=None, grammar: str | None = None) -> Grammar | None:
        """The Grammar of a response_format (OpenAI form) or a `grammar` string, or None for neither.

        grammar: "regex:PATTERN" for a regex, anything else is EBNF (GBNF: `root ::= ...`).
        Raises:
            ValueError: both given, a bad response_format, or an invalid schema, regex or grammar
                (the engine's message, shortened).
        """
        parsed = parse_response_format(response_format)
        if parsed is not None and grammar is not None:
            raise ValueError("give response_format or grammar, not both")
        if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
            raise ValueError("grammar must be a non-empty string: EBNF, or 'regex:PATTERN'")
        try:
            if parsed is not None and parsed[0] == "json_object":
                return Grammar(self._compiler.compile_builtin_json_grammar(), "json_object", self.vocab_size,
                               self.eos_token_ids)
            if parsed is not None:
                schema = parsed[1]
                ignored = unenforced_keywords(schema)
                if ignored:
                    raise ValueError(f"JSON schema keywords not enforced here (refused rather than ignored): "
                                     f"{', '.join(ignored)}")
                compiled = self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
                return Grammar(compiled, "json_schema", self.vocab_size, self.eos_token_ids)
            if grammar is None:
                return None
            if grammar.startswith("regex:"):
                compiled = Grammar(self._compiler.compile_regex(grammar[len("regex:"):]), "regex", self.vocab_size,
                                   self.eos_token_ids)
            else:
                compiled = Grammar(self._compiler.compile_grammar(grammar), "ebnf", self.vocab_size, self.eos_token_ids)
        except RuntimeError as err:
            what = "JSON schema" if parsed is not None else "regex" if grammar.startswith("regex:") else "grammar"
            raise ValueError(f"invalid {what}: {_short(err)}") from None
        # a grammar that allows no first token (e.g. the regex [^\s\S]) would mask every token of the
        # first position: refused here, not in a decoding step (which would end every request in it)
        if not compiled.state(0)._allowed().any():
            raise ValueError("the grammar accepts no text (no token can start it)")
        return compiled


class GrammarState:
    """One request's matcher, a pipeline transform (specdecode.processors): masks each position
    to the tokens the grammar allows after committed + drafts before it."""

    def __init__(self, grammar: Grammar, prompt_len: int):
        xgr = _xgrammar()
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.vocab_size, self.eos_token_ids = grammar.vocab_size, grammar.eos_token_ids
        self.prompt_len = prompt_len
        self._consumed = prompt_len  # committed tokens fed to the matcher (the prompt is not)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)

    def _sync(self, committed: Sequence[int]) -> None:
        for token in committed[self._consumed:]:
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"committed token {token} breaks the grammar (a bug: p was masked)")
        self._consumed = max(self._consumed, len(committed))

    def _allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        bits = (self._bitmask[0].unsqueeze(-1) >> self._bits) & 1
        return bits.view(-1)[:self.vocab_size].bool()

    def _next(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next, or, where the grammar has no continuation (a dead end
        such as the regex a[^\\s\\S] after "a"), the EOS ids: the output ends there instead of a
        position with every token masked (NaN probabilities, a failed step for every request)."""
        allowed = self._allowed()
        if not allowed.any() and self.eos_token_ids:
            allowed[[t for t in self.eos_token_ids if t < allowed.shape[0]]] = True
        return allowed

    def _advance(self, tokens: Sequence[int]) -> int:
        """Accept tokens while the grammar allows them; how many were accepted (roll them back!)."""
        accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            accepted += 1
        return accepted

    def __call__(self, committed, drafts, logits, start: int = 0):
        self._sync(committed)
        out = logits  # the pipeline's own copy: masked in place
        n, vocab = logits.shape
        accepted = self._advance(drafts[:start])
        try:
            if accepted < start:
                return out  # a refused draft before these positions: they are never used
            for i in range(n):
                if self.matcher.is_terminated():
                    break  # after the stop token: the request has ended, these positions are never used
                allowed = self._next()
                width = min(vocab, allowed.shape[0])
                out[i, :width].masked_fill_(~allowed[:width], float("-inf"))
                out[i, width:] = float("-inf")
                if i + 1 < n:
                    if self._advance(drafts[start + i:start + i + 1]) == 0:
                        break  # later positions follow a draft with p = 0: never used, left raw
                    accepted += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return out

    def valid_prefix(self, committed: Sequence[int], drafts: Sequence[int]) -> int:
        """How many drafts in a row the grammar accepts."""
        self._sync(committed)
        accepted = self._advance(drafts)
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def forced(self, committed: Sequence[int], drafts: Sequence[int]) -> int | None:
        """The only token allowed after committed + drafts; None for several (or drafts that break
        the grammar); ENDED after the stop token (nothing may follow)."""
        self._sync(committed)
        accepted = self._advance(drafts)
        try:
            if accepted < len(drafts):
                return None
            if self.matcher.is_terminated():
                return ENDED
            ids = self._next().nonzero()
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return int(ids[0]) if len(ids) == 1 else None
