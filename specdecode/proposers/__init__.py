"""Where drafts come from. Every proposer returns the tokens and the distributions q they were
sampled from (one-hot for deterministic proposers), so there is one verify path."""

from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.cross_vocab import CrossVocabProposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.fallback import FallbackProposer, find_proposer
from specdecode.proposers.ngram import NGramModel
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.proposers.suffix import SuffixProposer

__all__ = ["Draft", "Proposer", "CrossVocabProposer", "DraftModelProposer", "FallbackProposer", "NGramModel",
           "PromptLookupProposer", "SuffixProposer", "build_proposer", "find_proposer"]


def build_proposer(draft_backend, vocab_size: int, *, free_drafts: str | None = None, confidence: float = 0.0,
                   tree_width: int = 1, tree_confidence: float = 0.8, tokenizers=None,
                   cross_vocab: str = "auto", device=None) -> Proposer | None:
    """The proposer of a configured decoder: free drafts when asked (free_drafts "suffix": suffix
    drafts over the row and earlier requests; "ngram": prompt lookup, paper §3.6; None: none),
    composed with the draft model (draft_backend, or None) serving the rows they have no draft for
    (FallbackProposer(free drafts, draft model)); None decodes plainly. tokenizers: (draft's,
    target's) for a draft of another vocabulary, which proposes through the shared one
    (CrossVocabProposer; cross_vocab: its method; find_proposer finds it in the composition).
    device: where free drafts' tensors go (None: the draft model's device, else the CPU). Other
    arguments as DecoderConfig's (vocab_size: the target's).

    Raises:
        ValueError: free_drafts not None, "suffix" or "ngram".
    """
    if free_drafts not in (None, "suffix", "ngram"):
        raise ValueError(f"free_drafts must be None, 'suffix' or 'ngram', got {free_drafts!r}")
    if draft_backend is None:
        model = None
    elif tokenizers is not None:
        model = CrossVocabProposer(draft_backend, *tokenizers, vocab_size, cross_vocab, confidence)
    else:
        model = DraftModelProposer(draft_backend, confidence, tree_width, tree_confidence)
    if device is None and draft_backend is not None:
        device = draft_backend.device
    if free_drafts is None:
        return model
    free = (PromptLookupProposer if free_drafts == "ngram" else SuffixProposer)(vocab_size, device=device)
    return free if model is None else FallbackProposer(free, model)


def for_pair(pair, config, free_drafts: str | None, draft_backend=None, tree_width: int | None = None
             ) -> Proposer | None:
    """The proposer of a decoder as configured: its loaded Pair (specdecode.models.pair), its
    DecoderConfig and the planned free drafts; draft_backend replaces the draft's own (a benchmark
    wraps it), tree_width the configured one (a benchmark compares them)."""
    draft_backend = draft_backend or (pair.draft.backend if pair.draft is not None else None)
    return build_proposer(draft_backend, pair.target.backend.vocab_size, free_drafts=free_drafts,
                          confidence=config.draft_confidence,
                          tokenizers=(pair.draft.tokenizer, pair.tokenizer) if pair.cross_vocab else None,
                          device=pair.target.backend.device, cross_vocab=config.cross_vocab,
                          tree_width=config.tree_width if tree_width is None else tree_width,
                          tree_confidence=config.tree_confidence)
