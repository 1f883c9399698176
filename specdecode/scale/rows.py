"""One input line of a batch job → a validated row; one finished row → its output record.

Two line formats, detected per file from its first line:

- **OpenAI's batch format** (as OpenAI's Batch API and vLLM's `run-batch` read it): a line
  `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}` gives `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
  "error": null}` where `body` is what `specdecode serve` answers to that body (a completion,
  or an error object with its status code).
- **Simple lines**: a JSON object with `prompt` (a string, through the chat template unless the
  job is raw, as `specdecode generate`; or token ids, verbatim) or `messages` (always through the
  chat template), optionally `id` (a string or integer; default: the 1-based line number) and any
  field of the server's /v1/completions body (for `prompt`) or /v1/chat/completions body (for
  `messages`): max_tokens, temperature, top_p, top_k, min_p, seed, stop, the penalties,
  logprobs, response_format, grammar, ... Other fields (a dataset's own metadata) are ignored.
  The output line is {"id", "text", "finish_reason", "usage", "speculation"} (and "logprobs"
  when asked for; with `n` > 1, "choices": [{"index", "text", "finish_reason", "logprobs"?}]
  in place of text, finish_reason and logprobs; with `echo`, the text starts with the prompt),
  or {"id", "error"} for a line that breaks these rules; the job goes on.

Both formats are validated by the server's own schema (specdecode.frontend.schema), before any
model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdecode.engine.request import GenerationResult
from specdecode.engine.stats import GenerationStats
from specdecode.frontend.schema import ApiError, ChatRequest, CompletionRequest, parse

URLS = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}


@dataclass(frozen=True)
class RowDefaults:
    """What a simple line gets for a field it leaves out (the job's flags), and the job's model name."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False  # a `prompt` string goes in verbatim, without the chat template
    model: str = "specdecode"  # the served model name: OpenAI-format bodies must name it, as at the server

    def fill(self, fields: dict) -> dict:
        """A simple line's fields with the job's defaults where it has none."""
        defaults = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "seed": self.seed, "stop": list(self.stop) or None}
        return defaults | {k: v for k, v in fields.items() if k not in ("id", "model")}


@dataclass(frozen=True)
class Row:
    """A parsed input line. `id`: the key the output is matched by (a simple line's id, or an
    OpenAI-format line's custom_id). `request`: the validated body; `template`: for a completions
    body, whether its string prompt goes through the chat template (None: when the target has
    one). `error`: a line that broke the rules (the rest unused), as a one-line message or, for an
    OpenAI-format line whose body the server would refuse, as that ApiError."""

    id: str | int
    line: int
    request: ChatRequest | CompletionRequest | None = None
    template: bool | None = False
    openai: bool = False
    error: str | ApiError | None = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def row_key(row_id) -> str:
    """The id as the output file's index knows it: 3 and "3" are different ids."""
    return json.dumps(row_id)


def record_key(record: dict) -> str:
    """The key of an output record's row (its custom_id in OpenAI's format, else its id)."""
    return row_key(record["custom_id"] if "custom_id" in record else record["id"])


def is_openai_line(text: str) -> bool:
    """Whether a file whose first line this is uses OpenAI's batch format."""
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and "custom_id" in record


def parse_line(text: str, line: int, defaults: RowDefaults, openai: bool = False) -> Row:
    """One input line (1-based number `line`) → a Row; bad lines give Row.error.

    Raises:
        ValueError: an OpenAI-format line without a string custom_id, method POST and a known url
            (its output could not be matched to it; the job refuses the file).
    """
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as err:
        if openai:
            raise ValueError(f"line {line}: not JSON ({getattr(err, 'msg', type(err).__name__)})") from None
        return Row(line, line, error=f"line {line}: not JSON ({getattr(err, 'msg', type(err).__name__)})")
    if openai:
        return _openai_row(record, line)
    if not isinstance(record, dict):
        return Row(line, line, error=f"line {line}: expected a JSON object, got {type(record).__name__}")
    row_id = record.get("id", line)
    if not (_is_int(row_id) or isinstance(row_id, str)):
        return Row(line, line, error=f"line {line}: id must be a string or an integer, got {row_id!r}")
    if ("prompt" in record) == ("messages" in record):
        return Row(row_id, line, error=f'line {line}: give exactly one of "prompt" and "messages"')
    kind = ChatRequest if "messages" in record else CompletionRequest
    try:
        request = parse(kind, defaults.fill(record))
        refuse_in_batch(request)
    except ApiError as err:
        return Row(row_id, line, error=f"line {line}: {err.message}")
    template = None if kind is CompletionRequest and not defaults.raw else False
    return Row(row_id, line, request, template)


def _openai_row(record, line: int) -> Row:
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
        raise ValueError(f"line {line}: an OpenAI batch line needs a string \"custom_id\"")
    custom_id = record["custom_id"]
    if record.get("method", "POST") != "POST" or record.get("url") not in URLS:
        raise ValueError(f"line {line} (custom_id {custom_id!r}): needs \"method\": \"POST\" and \"url\" one of "
                         f"{', '.join(URLS)}")
    try:
        request = parse(URLS[record["url"]], record.get("body"))
        refuse_in_batch(request)
    except ApiError as err:
        return Row(custom_id, line, openai=True, error=err)
    return Row(custom_id, line, request, openai=True)


def refuse_in_batch(request) -> None:
    if request.stream:
        raise ApiError(400, "stream is not supported in a batch job: every output line is a whole response",
                       "stream")


def error_record(row: Row) -> dict:
    """A row that was not decoded: {"id", "error"}, or in OpenAI's format the server's error body."""
    if row.openai:
        return openai_record(row, row.error.status, row.error.body())
    return {"id": row.id, "error": str(row.error)}


def openai_record(row: Row, status: int, body: dict) -> dict:
    """An OpenAI-format output line: the server's answer to the line's body."""
    import uuid

    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": row.id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def result_record(row: Row, results: list[GenerationResult], body: dict) -> dict:
    """A simple line's output, from the results of its choices and the server's body for them:
    id, text, finish_reason (eos | stop | length), usage (token counts, an EOS that ended the
    text included), speculation stats, and the logprobs in the server's shape
    when the line asked for them. A line with n > 1 gets "choices": [{"index", "text",
    "finish_reason", "logprobs"?}, ...] instead of text, finish_reason and logprobs."""
    choices = []
    for result, choice in zip(results, body["choices"]):
        text = choice["message"]["content"] if "message" in choice else choice["text"]  # with echo's prompt
        entry = {"index": choice["index"], "text": text, "finish_reason": result.finish_reason}
        if choice["logprobs"] is not None:
            entry["logprobs"] = choice["logprobs"]
        choices.append(entry)
    record = {"id": row.id}
    if len(choices) == 1:
        record.update({k: v for k, v in choices[0].items() if k != "index"})
    else:
        record["choices"] = choices
    record["usage"] = body["usage"]
    record["speculation"] = GenerationStats.combine([r.stats for r in results]).to_dict()
    return record
