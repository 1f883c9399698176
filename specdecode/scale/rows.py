"""One input line of a batch job → a validated row; one finished row → its output record.

An input line is a JSON object with `prompt` (a string: through the chat template unless the job
is raw, as `specdecode generate`) or `messages` (a list of {"role", "content"}: always through
the chat template), and optionally `id` (a string or integer; default: the 1-based line number),
`max_tokens`, `temperature`, `top_p`, `seed` and `stop`. Other fields (a dataset's own metadata)
are ignored. A line that breaks these rules becomes an error record {"id", "error"}; the job
goes on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from specdecode.engine.request import GenerationResult

FIELDS = ("id", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop")


@dataclass(frozen=True)
class RowDefaults:
    """What a row gets for a field it leaves out (the job's flags)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False  # a `prompt` string goes in verbatim, without the chat template


@dataclass(frozen=True)
class Row:
    """A parsed input line. `error` is set (and the rest unused) for a bad line."""

    id: str | int
    line: int
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    error: str | None = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def row_key(row_id) -> str:
    """The id as the output file's index knows it: 3 and "3" are different ids."""
    return json.dumps(row_id)


def parse_line(text: str, line: int, defaults: RowDefaults) -> Row:
    """One input line (1-based number `line`) → a Row; never raises: a bad line gives Row.error."""
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as err:
        return Row(line, line, error=f"line {line}: not JSON ({getattr(err, 'msg', type(err).__name__)})")
    if not isinstance(record, dict):
        return Row(line, line, error=f"line {line}: expected a JSON object, got {type(record).__name__}")
    row_id = record.get("id", line)
    if not (_is_int(row_id) or isinstance(row_id, str)):
        return Row(line, line, error=f"line {line}: id must be a string or an integer, got {row_id!r}")

    def bad(message: str) -> Row:
        return Row(row_id, line, error=f"line {line}: {message}")

    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        return bad('give exactly one of "prompt" (a string) and "messages" (a list)')
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        return bad('"prompt" must be a non-empty string')
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return bad('"messages" must be a non-empty list of {"role": str, "content": str}')
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    max_tokens = record.get("max_tokens", defaults.max_tokens)
    if not _is_int(max_tokens) or max_tokens < 1:
        return bad(f'"max_tokens" must be an integer >= 1, got {max_tokens!r}')
    temperature = record.get("temperature", defaults.temperature)
    if not _is_number(temperature) or temperature < 0:
        return bad(f'"temperature" must be a number >= 0, got {temperature!r}')
    top_p = record.get("top_p", defaults.top_p)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        return bad(f'"top_p" must be a number in (0, 1], got {top_p!r}')
    seed = record.get("seed", defaults.seed)
    if seed is not None and (not _is_int(seed) or seed < 0):
        return bad(f'"seed" must be an integer >= 0, got {seed!r}')
    stop = record.get("stop", defaults.stop)
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        return bad(f'"stop" must be a non-empty string or a list of them, got {record.get("stop")!r}')
    return Row(row_id, line, prompt, messages, max_tokens, float(temperature), float(top_p), seed, tuple(stop))


def error_record(row: Row) -> dict:
    return {"id": row.id, "error": row.error}


def result_record(row: Row, result: GenerationResult, prompt_tokens: int) -> dict:
    """The output line of a finished row: id, text, finish_reason (eos | stop | length), usage
    (token counts; an EOS that ended the text is not a completion token) and speculation stats."""
    completion = len(result.token_ids) - int(result.finish_reason == "eos")
    return {"id": row.id, "text": result.text, "finish_reason": result.finish_reason,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion},
            "speculation": result.stats.to_dict()}
