"""Where drafts come from. Every proposer returns the tokens and the distributions q they were
sampled from (one-hot for deterministic proposers), so there is one verify path."""

from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.cross_vocab import CrossVocabProposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NGramModel, NGramProposer
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.proposers.suffix import SuffixProposer

__all__ = ["Draft", "Proposer", "CrossVocabProposer", "DraftModelProposer", "NGramModel", "NGramProposer", "PromptLookupProposer",
           "SuffixProposer", "build_proposer"]


def build_proposer(draft_backend, vocab_size: int, *, prompt_lookup: bool | str, confidence: float = 0.0,
                   tree_width: int = 1, tree_confidence: float = 0.8, tokenizers=None,
                   cross_vocab: str = "auto") -> Proposer | None:
    """The proposer of a configured decoder: free drafts first when asked (prompt_lookup True or
    "suffix": suffix drafts over the row and earlier requests; "ngram": prompt lookup, paper
    §3.6), with the draft model (draft_backend, or None) serving the other steps; None
    decodes plainly. tokenizers: (draft's, target's) for a draft of another vocabulary, which
    proposes through the shared one (CrossVocabProposer; cross_vocab: its method). Other
    arguments as SpeculativeDecoder's (vocab_size: the target's)."""
    if draft_backend is None:
        proposer = None
    elif tokenizers is not None:
        proposer = CrossVocabProposer(draft_backend, *tokenizers, vocab_size, cross_vocab, confidence)
    else:
        proposer = DraftModelProposer(draft_backend, confidence, tree_width, tree_confidence)
    if prompt_lookup == "ngram":
        proposer = PromptLookupProposer(vocab_size, fallback=proposer)
    elif prompt_lookup:
        proposer = SuffixProposer(vocab_size, fallback=proposer)
    return proposer
