"""specdecode: exact speculative decoding (Leviathan, Kalman, Matias, ICML 2023, arXiv 2211.17192)."""

from specdecode.decoder import GenerationStream, SpeculativeDecoder
from specdecode.decoding import GenerationResult, GenerationStats, TokenEvent
from specdecode.sampling import SamplingParams

__all__ = ["SpeculativeDecoder", "SamplingParams", "GenerationResult", "GenerationStats",
           "GenerationStream", "TokenEvent"]
__version__ = "0.1.0"
