"""Where drafts come from. Every proposer returns the tokens and the distributions q they were
sampled from (one-hot for deterministic proposers), so there is one verify path."""

from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NGramModel, NGramProposer
from specdecode.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer", "NGramModel", "NGramProposer", "PromptLookupProposer"]
