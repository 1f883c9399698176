"""Where drafts come from. Every proposer returns the tokens and the distributions q they were
sampled from (one-hot for deterministic proposers), so there is one verify path."""

from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NGramModel, NGramProposer
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.proposers.suffix import SuffixProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer", "NGramModel", "NGramProposer", "PromptLookupProposer",
           "SuffixProposer", "build_proposer"]


def build_proposer(draft_backend, vocab_size: int, *, prompt_lookup: bool | str, confidence: float = 0.0,
                   tree_width: int = 1, tree_confidence: float = 0.8) -> Proposer | None:
    """The proposer of a configured decoder: free drafts first when asked (prompt_lookup True or
    "ngram": prompt lookup, paper §3.6; "suffix": suffix drafts over the row and earlier
    requests), with the draft model (draft_backend, or None) serving the other steps; None
    decodes plainly. Arguments as SpeculativeDecoder's (vocab_size: the target's)."""
    proposer = DraftModelProposer(draft_backend, confidence, tree_width, tree_confidence) \
        if draft_backend is not None else None
    if prompt_lookup == "suffix":
        proposer = SuffixProposer(vocab_size, fallback=proposer)
    elif prompt_lookup:
        proposer = PromptLookupProposer(vocab_size, fallback=proposer)
    return proposer
