"""The OpenAI wire format of answers, shared by the server and the batch job: finished results and
step outputs turned into response bodies and stream chunks. Pure functions (no I/O).

Logprobs are the target's raw log-probabilities (before penalties, grammar and temperature), in
OpenAI's chat `logprobs.content[]` and legacy completions `logprobs` shapes. They cover exactly
the returned text: the EOS token that ends an output is not listed (nor counted in usage), and
where a stop string ends the output, the tokens listed are those whose text starts before it
(a token in which the stop begins is listed; `text_offset` never points past the text).
"""

from __future__ import annotations

import time
import uuid


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


def finish_reason(reason: str) -> str:
    """The engine's eos | stop | length → OpenAI's stop | length."""
    return "length" if reason == "length" else "stop"


def speculation(stats) -> dict:
    """The per-response `speculation` object (DESIGN.md §6 names)."""
    return {"num_drafted": stats.num_drafted, "num_accepted": stats.num_accepted,
            "acceptance_rate": stats.num_accepted / stats.num_drafted if stats.num_drafted else None,
            "alpha_estimate": stats.alpha_estimate if stats.num_accepted + stats.num_rejected else None,
            "mean_tokens_per_call": stats.mean_tokens_per_call, "num_target_calls": stats.num_target_calls,
            "accepted_per_position": list(stats.accepted_per_position)}


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


def full_response(ids: ResponseIds, result, prompt_tokens: int, tokenizer) -> dict:
    """The non-streamed body for a finished GenerationResult (tokenizer: for the logprobs' token texts).
    Logprobs cover exactly the returned text (GenerationResult.num_text_tokens)."""
    finished_by_eos = result.finish_reason == "eos"
    choice = {"index": 0, "finish_reason": finish_reason(result.finish_reason), "logprobs": None}
    if result.logprobs is not None:
        n = result.num_text_tokens
        choice["logprobs"] = logprobs_body(ids.chat, result.logprobs[:n], result.text_offsets[:n], tokenizer)
    if ids.chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {**ids.base(chunk=False), "choices": [choice],
            "usage": usage(prompt_tokens, len(result.token_ids) - int(finished_by_eos)),
            "speculation": speculation(result.stats)}


def chunk(ids: ResponseIds, text: str | None, tokens: list[dict], finish: str | None = None,
          role: bool = False, stats=None, logprobs: dict | None = None) -> dict:
    """One SSE chunk: a delta of text (chat: role first), the tokens it holds with their origin
    (an extension, for the live page), the finish reason on the last, running speculation stats,
    and the chunk's logprobs (chat_logprobs / completion_logprobs of its tokens)."""
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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
