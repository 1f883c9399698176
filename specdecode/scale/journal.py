"""A batch job's output file, resumable: which ids it already holds, and appending one line per row.

Every record is appended as one complete line in one write and flushed at once, so a job killed
at any moment leaves whole lines plus at most one half-written last line. Opening the file again
cuts that half line off (its row is then done again) and collects the ids already there (those
rows are skipped): nothing is lost and nothing is written twice.
"""

from __future__ import annotations

import json
import os

from specdecode.scale.rows import record_key


class OutputJournal:
    """The output JSONL of a batch job (created if missing).

    Attributes:
        done: the keys (rows.record_key) of the rows already written, results and errors alike.
        cut_bytes: bytes of a half-written last line removed on opening (0 if none).
    Raises (on construction):
        OSError: the file cannot be read, truncated or opened for appending.
        ValueError: a complete line that is not a JSON object with an "id" (or "custom_id"): not a batch output
            (nothing is changed then).
    """

    def __init__(self, path: str):
        self.path = path
        self.done, whole, size = scan(path)
        self.cut_bytes = size - whole
        if self.cut_bytes:  # a crash mid-write: the row is done again
            os.truncate(path, whole)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        """Writes the record as one line (one write call: the OS file holds it at once) and marks its id done."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # os.write may write less than asked (never in practice for a regular file)
            view = view[os.write(self._fd, view):]
        self.done.add(record_key(record))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "OutputJournal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scan(path: str) -> tuple[set[str], int, int]:
    """What an output file holds, changing nothing: (the keys of its rows, the bytes of its whole
    lines, its size); a missing file holds nothing.

    Raises:
        OSError: the file cannot be read.
        ValueError: a complete line that is not a batch output line.
    """
    if not os.path.exists(path):
        return set(), 0, 0
    with open(path, "rb") as f:
        data = f.read()
    whole = data[:data.rfind(b"\n") + 1]
    done = set()
    for number, line in enumerate(whole.split(b"\n")[:-1], 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict) or not ("id" in record or "custom_id" in record):
            raise ValueError(f"{path}:{number} is not a batch output line (a JSON object with an \"id\"); "
                             "pass another --output or remove the file")
        done.add(record_key(record))
    return done, len(whole), len(data)
