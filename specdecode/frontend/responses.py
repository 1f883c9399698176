"""The OpenAI wire format of answers, shared by the server and the batch job: finished results and
step outputs turned into response bodies and stream chunks. Pure functions (no I/O).

Logprobs are the target's raw log-probabilities (before penalties, grammar and temperature), in
OpenAI's chat `logprobs.content[]` and legacy completions `logprobs` shapes. They cover exactly
the returned text: where a stop string ends the output, the tokens listed are those whose text
starts before it (a token in which the stop begins is listed; `text_offset` never points past
the text); an EOS that ends an output is listed (it adds no text) and counted in usage, as
vLLM does, so a harness asking `max_tokens: 1` always reads one generated token.

A request for n choices of P prompts gets choices indexed 0..P·n-1, prompt-major (streamed: chunks
of the choices interleave, each naming its index), and `usage` counting each prompt once and every
choice's tokens. A completions request with `echo` gets the prompt text before each choice's text and, with
`logprobs`, the prompt tokens' entries first (the first token's logprob and alternatives null).
"""

from __future__ import annotations

import time
import uuid

from specdecode.engine.stats import GenerationStats
from specdecode.engine.text import IncrementalDetokenizer


def chat_logprobs(entries, token_text) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}.
    token_text: id → its text."""
    def item(token_id, logprob):
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries, token_text, offsets: list[int]) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs ({text: logprob} per
    token), text_offset (offsets: where each token's text starts in the returned text, characters)."""
    return {"tokens": [token_text(e.token_id) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": list(offsets)}


def logprobs_body(chat: bool, entries, offsets: list[int], tokenizer) -> dict:
    """The `logprobs` of a choice or chunk in the endpoint's shape. entries: TokenLogprobs of the
    tokens whose text is returned (a stop may cut the output inside its last one)."""
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return chat_logprobs(entries, token_text) if chat else completion_logprobs(entries, token_text, offsets)


def echo_logprobs(prompt_ids: list[int], entries, tokenizer) -> dict:
    """Legacy completions `logprobs` of the prompt's tokens (echo): entries are
    GenerationResult.prompt_logprobs (None first); text_offset where each token's text starts,
    decoded token by token as outputs are (engine.text: linear in the prompt's length)."""
    detok, offsets, length = IncrementalDetokenizer(tokenizer, []), [], 0
    for token in prompt_ids:
        offsets.append(length)
        length += len(detok.push(token))
    return {"tokens": [tokenizer.decode([t]) for t in prompt_ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def join_logprobs(first: dict, then: dict | None, shift: int) -> dict:
    """Legacy completions logprobs of `first`'s text followed by `then`'s (its offsets + shift)."""
    if then is None:
        return first
    return {"tokens": first["tokens"] + then["tokens"], "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
            "text_offset": first["text_offset"] + [shift + o for o in then["text_offset"]]}


def finish_reason(reason: str) -> str:
    """The engine's eos | stop | length → OpenAI's stop | length."""
    return "length" if reason == "length" else "stop"


def speculation(stats) -> dict:
    """The per-response `speculation` object (docs/api.md's statistics names)."""
    return {"num_drafted": stats.num_drafted, "num_accepted": stats.num_accepted,
            "acceptance_rate": stats.num_accepted / stats.num_drafted if stats.num_drafted else None,
            "alpha_estimate": stats.alpha_estimate if stats.num_accepted + stats.num_rejected else None,
            "mean_tokens_per_call": stats.mean_tokens_per_call, "num_target_calls": stats.num_target_calls,
            "accepted_per_position": list(stats.accepted_per_position),
            "batch_invariant": stats.batch_invariant, "repeatable": stats.repeatable}


def usage(prompt_tokens: int, completion: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class ResponseIds:
    """The id, creation time and model name shared by a response's chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def completion_tokens(result) -> int:
    """Tokens a result adds to usage: every token generated, an EOS that ended it included (as
    vLLM counts)."""
    return len(result.token_ids)


def full_response(ids: ResponseIds, results, prompt_tokens: int, tokenizer, wire=None) -> dict:
    """The non-streamed body for a request's finished GenerationResults, one per choice
    (tokenizer: for the logprobs' token texts; wire: the frontend.builder.WireRequest, for echo).
    Logprobs cover exactly the returned text (GenerationResult.num_returned_tokens)."""
    choices = []
    for index, result in enumerate(results):
        echo = wire.echo[index // wire.n] if wire is not None and wire.echo is not None else None
        choice = {"index": index, "finish_reason": finish_reason(result.finish_reason), "logprobs": None}
        if result.logprobs is not None:
            choice["logprobs"] = logprobs_body(ids.chat, result.logprobs, result.text_offsets, tokenizer)
        if ids.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text if echo is None else echo + result.text
            if echo is not None and result.logprobs is not None:
                prompt_ids = wire.prompt_ids[index // wire.n]
                choice["logprobs"] = join_logprobs(echo_logprobs(prompt_ids, result.prompt_logprobs, tokenizer),
                                                   choice["logprobs"], len(echo))
        choices.append(choice)
    stats = GenerationStats.combine([r.stats for r in results])
    return {**ids.base(chunk=False), "choices": choices,
            "usage": usage(prompt_tokens, sum(completion_tokens(r) for r in results)),
            "speculation": speculation(stats)}


def chunk(ids: ResponseIds, text: str | None, tokens: list[dict], finish: str | None = None,
          role: bool = False, stats=None, logprobs: dict | None = None, index: int = 0) -> dict:
    """One SSE chunk: a delta of text (chat: role first), the tokens it holds with their origin
    (an extension, for the live page), the finish reason on the last, running speculation stats,
    and the chunk's logprobs (chat_logprobs / completion_logprobs of its tokens); index: the choice."""
    choice: dict = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if ids.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {**ids.base(chunk=True), "choices": [choice]}
    if tokens:
        body["tokens"] = tokens
    if stats is not None:
        body["speculation"] = speculation(stats)
    return body
