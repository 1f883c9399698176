"""A batch job on one decoder: read the input JSONL, skip the ids the output already holds, decode
the rest through the engine as one continuous batch, and append each row's record as it finishes.

The same `decode_rows` serves a Ray Data worker (specdecode.scale.ray_data), so a row's output
does not depend on where it ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from specdecode.frontend.builder import WireRequest
from specdecode.frontend import responses
from specdecode.frontend.schema import ApiError, ChatRequest, check_model
from specdecode.scale.journal import OutputJournal
from specdecode.scale.rows import (Row, RowDefaults, error_record, is_openai_line, openai_record, parse_line,
                                   result_record, row_key)


def read_rows(path: str, defaults: RowDefaults) -> list[Row]:
    """Every non-blank line of the input JSONL, parsed (bad lines as rows with .error); the format
    (OpenAI's batch lines or simple lines, rows.py) is the first line's.

    Raises:
        OSError: the file cannot be read.
        ValueError: two lines with the same id (resuming could not tell them apart), no rows, or
            an OpenAI-format line that cannot be matched to its output (rows.parse_line).
    """
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    rows, seen, openai = [], {}, None
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            if openai:
                raise ValueError(f"{path}:{number}: not UTF-8") from None
            rows.append(Row(number, number, error=f"line {number}: not UTF-8"))
        else:
            if openai is None:
                openai = is_openai_line(text)
            try:
                rows.append(parse_line(text, number, defaults, openai))
            except ValueError as err:
                raise ValueError(f"{path}:{err}") from None
        key = row_key(rows[-1].id)
        if key in seen:
            name = "custom_id" if openai else "id"
            raise ValueError(f"{path}:{number}: {name} {rows[-1].id!r} is also on line {seen[key]}; {name}s must be "
                             "unique (the output is matched to the input by them)")
        seen[key] = number
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def build_request(decoder, row: Row, model: str) -> WireRequest:
    """The engine work of a good row on this decoder (a SpeculativeDecoder): the server's own
    request path (frontend.builder.WireRequest: a Request per choice, the prompt).

    Raises:
        ApiError: what the server would answer to the row's body (400 for a prompt the model
            cannot take, 404 for an OpenAI-format body naming another model).
    """
    if row.openai:
        check_model(row.request, model)
    return decoder.requests.from_wire(row.request, row.template)


def decode_rows(decoder, rows: Iterable[Row], max_batch_size: int, model: str = RowDefaults.model,
                on_record: Callable[[dict], None] = lambda record: None) -> list[dict]:
    """Decodes the rows through the decoder's engine, at most max_batch_size at once (the next joins
    as one finishes), calling on_record with each row's output record as soon as it is final
    (error records at once). model: the job's served model name. Returns the records in the
    order they were made."""
    records = []

    def emit(record: dict) -> None:
        records.append(record)
        on_record(record)

    def submit(row: Row):
        if row.error is not None:
            emit(error_record(row))
            return None
        try:
            wire = build_request(decoder, row, model)
        except ApiError as err:
            emit(error_record(dataclasses.replace(row, error=err if row.openai else f"line {row.line}: {err.message}")))
            return None
        return wire.requests, wire

    def finish(row: Row, results, wire) -> None:
        ids = responses.ResponseIds(isinstance(row.request, ChatRequest), model)
        body = responses.full_response(ids, results, wire.prompt_tokens, decoder.tokenizer, wire)
        emit(openai_record(row, 200, body) if row.openai else result_record(row, results, body))

    decoder.driver.decode_all(rows, submit, finish, max_batch_size)
    return records


@dataclass
class BatchSummary:
    """What a job did. rows: in the input; skipped: already in the output before this run;
    done, failed: rows written by this run (results, error records); tokens: completion tokens.
    wall_time_s: the job's time in this process (a local run's excludes model loading, as the
    decoder is built before; a Ray run's includes the cluster start and the workers' loading).
    decode_time_s: a Ray run's time with workers decoding, from the first batch's start to the
    last one's end on the workers' clocks; None for a local run, whose wall time is that already.
    """

    rows: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_time_s: float = 0.0
    decode_time_s: float | None = None
    cut_bytes: int = 0

    def add(self, record: dict) -> None:
        """Count one output line: a simple line, or an OpenAI-format one (whose "error" is always
        null: its response's status code says whether the row failed)."""
        if "response" in record:
            failed, body = record["response"]["status_code"] != 200, record["response"]["body"]
        else:
            failed, body = record.get("error") is not None, record
        if failed:
            self.failed += 1
            return
        self.done += 1
        self.tokens += body["usage"]["completion_tokens"]
        self.drafted += body["speculation"]["num_drafted"]
        self.accepted += body["speculation"]["num_accepted"]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_time_s if self.wall_time_s else 0.0

    def line(self) -> str:
        acceptance = f"{self.acceptance_rate:.3f}" if self.drafted else "n/a"
        decoding = (f" ({self.tokens / self.decode_time_s:.2f} tokens/s over the {self.decode_time_s:.1f} s the "
                    "workers decoded)" if self.decode_time_s else "")
        return (f"{self.done} rows done, {self.failed} failed, {self.skipped} already in the output; "
                f"{self.tokens} tokens in {self.wall_time_s:.1f} s ({self.tokens_per_second:.2f} tokens/s){decoding}, "
                f"acceptance rate {acceptance}")


class Progress:
    """Counts finished records against the rows to do; `on_update(summary, todo)` after each."""

    def __init__(self, summary: BatchSummary, todo: int, on_update=None):
        self.summary, self.todo, self.on_update = summary, todo, on_update
        self.start = time.perf_counter()

    def __call__(self, record: dict) -> None:
        self.summary.add(record)
        self.summary.wall_time_s = time.perf_counter() - self.start
        if self.on_update is not None:
            self.on_update(self.summary, self.todo)


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped a job; `summary` holds what it wrote before."""

    def __init__(self, summary: BatchSummary):
        super().__init__("interrupted")
        self.summary = summary


def run_batch(decoder, input_path: str, output_path: str, defaults: RowDefaults = RowDefaults(),
              max_batch_size: int = 8, on_update=None) -> BatchSummary:
    """Runs (or resumes) a job on one decoder; returns its summary.

    Args:
        decoder: a SpeculativeDecoder.  input_path, output_path: JSONL files (rows.py, journal.py).
        defaults: the fields a row leaves out.  max_batch_size: rows decoded together (>= 1).
        on_update: called with (BatchSummary, rows to do in this run) after each row is written.
    Raises:
        OSError, ValueError: as read_rows and OutputJournal (before any row is decoded).
    """
    with job(input_path, output_path, defaults, on_update) as (rows, summary, write):
        decode_rows(decoder, rows, max_batch_size, defaults.model, write)
    return summary


@contextlib.contextmanager
def job(input_path: str, output_path: str, defaults: RowDefaults, on_update=None):
    """The part of a run that does not decode, shared by the local and the Ray run: reads the
    input (all of it checked before the output is opened or created), opens the output journal,
    yields (rows still to do, the summary, write(record)) where write appends a record and moves
    the progress, and stamps the wall time at the end.

    Raises:
        Interrupted: KeyboardInterrupt while the job ran (the rows written so far stay).
    """
    rows = read_rows(input_path, defaults)
    with OutputJournal(output_path) as journal:
        todo = [row for row in rows if row_key(row.id) not in journal.done]
        summary = BatchSummary(rows=len(rows), skipped=len(rows) - len(todo), cut_bytes=journal.cut_bytes)
        progress = Progress(summary, len(todo), on_update)

        def write(record: dict) -> None:
            journal.append(record)
            progress(record)

        try:
            yield todo, summary, write
        except KeyboardInterrupt:
            summary.wall_time_s = time.perf_counter() - progress.start
            raise Interrupted(summary) from None
        summary.wall_time_s = time.perf_counter() - progress.start
