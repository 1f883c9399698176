"""A draft with another tokenizer and vocabulary than the target's (Timor et al., "Accelerating LLM
Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML 2025,
arXiv 2502.05202). Both of its lossless methods, chosen per request:

- **TLI** (token-level intersection; sampled requests): the draft's distribution restricted to the
  token strings both vocabularies hold, renormalized; a draft token is sampled from it and sent
  as the target's id of the same string, with q (over the target's vocabulary) that restricted
  distribution. The ordinary rejection rule then gives the target's distribution exactly (paper
  §2.3 holds for any q; q is zero where the draft cannot propose).
- **SLEM** (string-level exact match; greedy requests): the draft decodes greedily in its whole
  vocabulary, its text is tokenized by the target's tokenizer, and those target tokens are the
  draft, with one-hot q. A deterministic proposal, so exact as every one-hot draft is (under any
  target sampling; it is chosen for greedy requests, where the draft's whole vocabulary helps most).

The draft reads the committed text in its own tokens: after every step the committed target
tokens are decoded and tokenized again by the draft's tokenizer, and the draft's cache keeps the
longest prefix that still agrees (a merge across the boundary rolls it back a token or two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.proposers.base import Draft, DraftRow, no_draft
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.sampling import SamplingParams

METHODS = ("auto", "tli", "slem")
GREEDY = SamplingParams(temperature=0)


def token_strings(tokenizer) -> dict[str, int]:
    """{token string: id}, with SentencePiece's word marker written as byte-level BPE's (▁ → Ġ),
    so the two families' strings compare."""
    return {token.replace("\u2581", "\u0120"): i for token, i in tokenizer.get_vocab().items()}


def shared_vocabulary(target_tokenizer, draft_tokenizer, draft_width: int, target_width: int) -> torch.Tensor:
    """to_target: [draft_width] int64, the target id of each draft id whose string the target's
    vocabulary also holds (special tokens included where their text is the same), −1 elsewhere.
    One to one: a target id is given to one draft id only (so q moves over without merging)."""
    target = token_strings(target_tokenizer)
    to_target = torch.full((draft_width,), -1, dtype=torch.long)
    taken = set()
    for token, draft_id in sorted(token_strings(draft_tokenizer).items(), key=lambda item: item[1]):
        target_id = target.get(token)
        if target_id is not None and draft_id < draft_width and target_id < target_width and target_id not in taken:
            to_target[draft_id] = target_id
            taken.add(target_id)
    return to_target


class _SharedOnly:
    """A draft-side logits transform (the DraftModelProposer pipeline protocol): tokens outside the
    shared vocabulary get −inf, so the draft samples from its restricted distribution (TLI)."""

    grammar = None

    def __init__(self, allowed: torch.Tensor):
        self.allowed, self.vocab_size = allowed, allowed.shape[0]

    def __call__(self, tokens, drafts, scores: torch.Tensor, start: int = 0) -> torch.Tensor:
        width = scores.shape[-1]
        allowed = self.allowed[:width] if width <= self.vocab_size else torch.nn.functional.pad(
            self.allowed, (0, width - self.vocab_size))
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))


@dataclass
class _DraftSide:
    """A row as the draft sees it (DraftRow): the committed text in the draft's tokens."""

    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    pipeline: object = None
    race_seed: None = None  # the target's race noise is indexed by its own ids: not shared here


class CrossVocabProposer(DraftModelProposer):
    """Drafts with a model of another vocabulary (TLI for sampled requests, SLEM for greedy ones).

    Args:
        backend: the draft's model backend.  draft_tokenizer, target_tokenizer: the two tokenizers.
        target_vocab_size: V of the target's logits (the width of q).
        method: "auto" (TLI for sampled requests, SLEM for greedy), "tli" or "slem" for all.
        confidence_threshold: as DraftModelProposer (dynamic γ).
        min_shared: refuse a pair whose shared vocabulary holds fewer token strings (or, for
            vocabularies under 2·min_shared, fewer than half of the smaller one).
    Raises:
        ValueError: an unknown method, or a shared vocabulary smaller than min_shared (the draft
            could propose too little of what the target writes to help).
    """

    def __init__(self, backend, draft_tokenizer, target_tokenizer, target_vocab_size: int, method: str = "auto",
                 confidence_threshold: float = 0.0, min_shared: int = 1000):
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        super().__init__(backend, confidence_threshold)
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.target_vocab_size, self.method = target_vocab_size, method
        self.to_target = shared_vocabulary(target_tokenizer, draft_tokenizer, backend.vocab_size, target_vocab_size)
        self.num_shared = int((self.to_target >= 0).sum())
        # an absolute floor for large vocabularies; a small one (a test's, a character model's) is
        # judged by the share of it that the two hold in common
        if self.num_shared < min(min_shared, min(len(draft_tokenizer), len(target_tokenizer)) // 2):
            raise ValueError(f"the draft's and the target's vocabularies share {self.num_shared} token strings "
                             f"(of {len(draft_tokenizer)} and {len(target_tokenizer)}): too few for the draft to help; "
                             "pick a draft whose tokenizer is closer to the target's")
        self._shared_only = _SharedOnly(self.to_target >= 0)
        # the shared draft ids and their target ids, once (TLI moves q along them every step)
        device = backend.device
        self._target_ids = self.to_target.to(device)
        self._shared = (self.to_target >= 0).nonzero().squeeze(-1).to(device)
        self._shared_targets = self._target_ids[self._shared]
        self.targets: list[list[int]] = []   # per row: its committed target tokens
        self.shadow: list[list[int]] = []    # per row: the draft's tokens of their text
        self._drafted: list[list[int]] = []  # per row: this step's draft tokens (draft ids)

    def uses_slem(self, sampling: SamplingParams) -> bool:
        """Which method a request gets: SLEM for greedy ones under "auto"."""
        return self.method == "slem" or (self.method == "auto" and sampling.greedy)

    def add_row(self, prompt_ids: Sequence[int], encoder_input_ids: Sequence[int] | None = None) -> None:
        self.targets.append(list(prompt_ids))
        self.shadow.append(self._draft_tokens(prompt_ids))
        self._drafted.append([])
        super().add_row(self.shadow[-1], encoder_input_ids)

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        self.targets = [self.targets[b] for b in rows]
        self.shadow = [self.shadow[b] for b in rows]
        self._drafted = [self._drafted[b] for b in rows]

    def propose(self, rows: Sequence[DraftRow], ks: list[int]) -> list[Draft]:
        slem = [self.uses_slem(row.sampling) for row in rows]
        sides = [_DraftSide(self.shadow[b], GREEDY, row.generator) if slem[b] else
                 _DraftSide(self.shadow[b], row.sampling, row.generator, self._shared_only)
                 for b, row in enumerate(rows)]
        drafts = super().propose(sides, ks)
        self._drafted = [d.tokens.tolist() for d in drafts]
        return [self._to_target(d, k, s) if len(d.tokens) else no_draft(self.target_vocab_size, self.backend.device)
                for d, k, s in zip(drafts, ks, slem)]

    def commit(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for b, (state, new) in enumerate(zip(self.rows, new_tokens)):
            self.targets[b].extend(new)
            shadow = self._draft_tokens(self.targets[b])
            # the cache holds the committed draft tokens up to `base` and the first `fed` drafts:
            # it keeps what agrees with the new tokenization (never all of it: the last token is
            # fed with the next proposal)
            cached = self.shadow[b][:state.base] + self._drafted[b][:state.fed]
            keep = next((i for i, (x, y) in enumerate(zip(cached, shadow)) if x != y), min(len(cached), len(shadow)))
            keep = min(keep, len(shadow) - 1)
            state.base, state.pending = keep, shadow[keep:]
            state.drafted = state.fed = 0
            self.shadow[b], self._drafted[b] = shadow, []
        self.backend.truncate([state.base for state in self.rows])

    def _draft_tokens(self, target_ids: Sequence[int]) -> list[int]:
        """The draft tokenizer's tokens of the text these target tokens decode to (special tokens
        kept as text, so a chat template's markers map across where both have them)."""
        text = self.target_tokenizer.decode(list(target_ids), skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)
        ids = self.draft_tokenizer.encode(text, add_special_tokens=False)
        return ids or [self.draft_tokenizer.eos_token_id or 0]

    def _to_target(self, draft: Draft, k: int, slem: bool) -> Draft:
        """The draft in the target's ids: TLI maps each (shared) token and spreads q over the
        target's vocabulary; SLEM tokenizes the draft's text for the target (one-hot q)."""
        device = self.backend.device
        if slem:
            text = self.draft_tokenizer.decode(draft.tokens.tolist(), skip_special_tokens=False,
                                               clean_up_tokenization_spaces=False)
            ids = [t for t in self.target_tokenizer.encode(text, add_special_tokens=False)
                   if t < self.target_vocab_size][:k]
            if not ids:
                return no_draft(self.target_vocab_size, device)
            tokens = torch.tensor(ids, dtype=torch.long, device=device)
            return Draft(tokens, torch.nn.functional.one_hot(tokens, self.target_vocab_size).float(),
                         forwards=draft.forwards)
        tokens = self._target_ids[draft.tokens]
        probs = torch.zeros((len(tokens), self.target_vocab_size), dtype=draft.probs.dtype, device=device)
        probs[:, self._shared_targets] = draft.probs[:, self._shared]
        return Draft(tokens, probs, forwards=draft.forwards)
