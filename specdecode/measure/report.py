"""Where measurements go: a JSON file with everything and a Markdown file for people, both
headed by the date, machine, versions and the command that produced them."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from specdecode.tune.hardware import cpu_report, describe


def environment(**extra) -> dict:
    """Date (UTC), machine (its CPU class: torch's capability, native bfloat16 or not, the kernel
    flags), thread count, versions, the command line, and `extra`."""
    import transformers

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": describe(cpu_report()),
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command": "specdecode " + " ".join(sys.argv[1:]), **extra}


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write(out: str | Path, title: str, meta: dict, body: list[str], data: dict) -> tuple[Path, Path]:
    """Writes OUT.json ({"meta", **data}) and OUT.md (title, meta, body). Returns both paths."""
    json_path, md_path = Path(f"{out}.json"), Path(f"{out}.md")  # OUT may contain dots
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, **data}, indent=2, ensure_ascii=False))
    head = [f"# {title}", "", "| " + " | ".join(f"{k}: {v}" for k, v in meta.items() if k != "command") + " |",
            "|" + "---|" * (len(meta) - 1), "", f"Command: `{meta['command']}`", ""]
    md_path.write_text("\n".join(head + body) + "\n")
    return json_path, md_path


def fmt(value, digits: int = 2) -> str:
    return "–" if value is None or value != value else f"{value:.{digits}f}"
