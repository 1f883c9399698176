"""specdecode: exact speculative decoding (Leviathan, Kalman, Matias, ICML 2023, arXiv 2211.17192)."""

from specdecode.api import GenerationStream, SpeculativeDecoder
from specdecode.config import DecoderConfig
from specdecode.engine.request import GenerationResult, TokenEvent
from specdecode.engine.stats import GenerationStats
from specdecode.sampling import SamplingParams

__all__ = ["SpeculativeDecoder", "DecoderConfig", "SamplingParams", "GenerationResult", "GenerationStats",
           "GenerationStream", "TokenEvent"]
__version__ = "0.1.0"
