"""specdecode: exact speculative decoding (Leviathan, Kalman, Matias, ICML 2023, arXiv 2211.17192).

The public names load on first use (PEP 562), so `specdecode --help` or a usage error answers
without importing torch.
"""

import importlib

_NAMES = {"SpeculativeDecoder": "specdecode.api", "GenerationStream": "specdecode.engine.stream",
          "DecoderConfig": "specdecode.config", "GenerationResult": "specdecode.engine.request",
          "TokenEvent": "specdecode.engine.request", "GenerationStats": "specdecode.engine.stats",
          "SamplingParams": "specdecode.sampling_params"}

__all__ = ["SpeculativeDecoder", "DecoderConfig", "SamplingParams", "GenerationResult", "GenerationStats",
           "GenerationStream", "TokenEvent"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
