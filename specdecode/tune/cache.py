"""The choice cache: what dtype="auto" measured, per machine, model pair and library version, so
that a second start measures nothing (~/.cache/specdecode/choices/KEY.json)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from specdecode.tune.costs import Choice
from specdecode.tune.hardware import cpu_report

CACHE_VERSION = 9  # bumped when what is measured or how the choice is made changes (9: the batch-invariant target)


def cache_key(target_name: str, draft_name: str | None, max_gamma: int, candidates: tuple[str, ...]) -> str:
    """What a measurement depends on: this machine (CPU, flags, torch, threads, emulation), the
    pair, γ_max, the candidates timed and the library's versions (llama.cpp's build too where it is
    a candidate: an AVX2-only build runs other kernels than an AVX-512 one)."""
    import transformers

    from specdecode.models import llamacpp
    from specdecode.models.quant import kernel_layout

    parts = {"machine": cpu_report(), "target": target_name, "draft": draft_name, "max_gamma": max_gamma,
             "candidates": list(candidates), "transformers": transformers.__version__, "kernels": kernel_layout(),
             "version": CACHE_VERSION}
    if any(c.startswith("llama.cpp") or c == "gguf" for c in candidates):
        parts["llama.cpp"] = llamacpp.system_info()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    from specdecode.models.zoo import cache_dir

    return cache_dir() / "choices" / f"{key}.json"


def load_choice(key: str) -> Choice | None:
    """The cached Choice for this key, or None (missing or unreadable: measured again)."""
    try:
        data = json.loads(cache_path(key).read_text(encoding="utf-8"))
        data["notes"] = tuple(data.get("notes", ()))
        return Choice(**data)
    except (OSError, ValueError, TypeError):
        return None


def save_choice(key: str, choice: Choice) -> None:
    """Write atomically; a cache that cannot be written only costs the next start its measurement."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(choice), f)
        os.replace(tmp, path)
    except OSError:
        pass
