"""Backends that own a KV cache for B rows (one per running request); rollback sets a length.

Every backend implements the protocol declared in specdecode.models.backend (Backend, and
DecoderBackend for decoder-only models: fill and score); docs/ARCHITECTURE.md walks through it and
tests/test_backend_protocol.py checks every backend against it.
"""

import importlib

_NAMES = {"HFCausalLM": "specdecode.models.hf", "Seq2SeqLM": "specdecode.models.seq2seq",
          "TableModel": "specdecode.models.table", "Backend": "specdecode.models.backend",
          "DecoderBackend": "specdecode.models.backend", "TreeBackend": "specdecode.models.backend"}
__all__ = ["Backend", "DecoderBackend", "TreeBackend", "HFCausalLM", "Seq2SeqLM", "TableModel"]


def __getattr__(name: str):  # loaded on first use: the CLI reads zoo names without importing torch
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdecode.models' has no attribute {name!r}")
