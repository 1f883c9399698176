"""Proposers by composition: FallbackProposer(first, then) serves each row from free drafts where
they have one and from the draft model elsewhere, in one batched call; build_proposer composes
them; the proposer timers add up through the composition."""

from types import SimpleNamespace

import pytest
import torch

from specdecode.models import TableModel
from specdecode.proposers import (DraftModelProposer, FallbackProposer, PromptLookupProposer, SuffixProposer,
                                  build_proposer, find_proposer)
from specdecode.proposers.base import proposer_reads
from specdecode.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def rows(*sequences):
    return [SimpleNamespace(tokens=list(s), sampling=GREEDY, generator=None, pipeline=None) for s in sequences]


class Recording(DraftModelProposer):
    """A draft model that records each propose call's ks."""

    def __init__(self, backend):
        super().__init__(backend)
        self.calls = []

    def propose(self, rows, ks):
        self.calls.append(list(ks))
        return super().propose(rows, ks)


def test_rows_with_a_free_draft_take_it_and_the_others_go_to_the_draft_model_in_one_call():
    then = Recording(TableModel(10, seed=3))
    proposer = FallbackProposer(PromptLookupProposer(10, max_ngram=2, min_ngram=1), then)
    sequences = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7]]
    for s in sequences:
        proposer.add_row(s)
    drafts = proposer.propose(rows(*sequences), [3, 2, 0])
    assert then.calls == [[0, 2, 0]]  # the matched row and the row planned 0 ask nothing of it
    assert drafts[0].tokens.tolist() == [3, 1, 2] and drafts[0].lookup and drafts[0].forwards == 0
    assert len(drafts[1].tokens) == 2 and not drafts[1].lookup and drafts[1].forwards == 2
    assert len(drafts[2].tokens) == 0
    assert then.backend.num_rows == 3  # every row joined both parts


def test_select_and_commit_reach_both_parts():
    first = SuffixProposer(10, levels=(1, 2), cache_tokens=100)
    then = DraftModelProposer(TableModel(10, seed=3))
    proposer = FallbackProposer(first, then)
    proposer.add_row([1, 2, 3])
    proposer.add_row([4, 5])
    proposer.propose(rows([1, 2, 3], [4, 5]), [2, 2])
    proposer.commit([0, 0], [[9], [8]])
    assert [own.sequences[0] for _, own in first._rows] == [[1, 2, 3, 9], [4, 5, 8]]
    proposer.select([1])
    assert then.backend.num_rows == 1 and len(first._rows) == 1
    assert first.cache.sequences  # the row that left joined the suffix cache


class Timed:
    """A stand-in part with fixed timers."""

    max_rows = None

    def __init__(self, time_s, read_s, read_tokens, unread=None):
        self.time_s, self.read_s, self.read_tokens, self._unread = time_s, read_s, read_tokens, unread

    def unread(self):
        return self._unread


def test_the_timers_of_a_composed_proposer_are_the_sums_of_its_parts():
    proposer = FallbackProposer(Timed(0.5, 0.0, 0), Timed(2.0, 0.25, 7, unread=[3, 0]))
    assert proposer.time_s == 2.5 and proposer_reads(proposer) == (0.25, 7)
    assert proposer.unread() == [3, 0]
    bare = SimpleNamespace(max_rows=4)  # a user's proposer without timers counts none
    assert proposer_reads(FallbackProposer(bare, Timed(1.0, 0.5, 2))) == (0.5, 2)
    assert FallbackProposer(bare, Timed(1.0, 0.5, 2)).unread() is None
    assert FallbackProposer(bare, SimpleNamespace(max_rows=2)).max_rows == 2


def test_find_proposer_finds_the_part_of_a_kind_in_a_composition():
    then = DraftModelProposer(TableModel(10, seed=3))
    free = PromptLookupProposer(10)
    composed = FallbackProposer(free, then)
    assert find_proposer(composed, DraftModelProposer) is then
    assert find_proposer(composed, PromptLookupProposer) is free
    assert find_proposer(then, DraftModelProposer) is then
    assert find_proposer(composed, SuffixProposer) is None and find_proposer(None, SuffixProposer) is None


@pytest.mark.parametrize("free_drafts,kind", [("suffix", SuffixProposer), ("ngram", PromptLookupProposer)])
def test_build_proposer_puts_free_drafts_first_and_the_draft_model_after_them(free_drafts, kind):
    backend = TableModel(10, seed=3)
    proposer = build_proposer(backend, 10, free_drafts=free_drafts, confidence=0.3)
    assert isinstance(proposer, FallbackProposer) and isinstance(proposer.first, kind)
    assert isinstance(proposer.then, DraftModelProposer) and proposer.then.backend is backend
    assert proposer.then.confidence_threshold == 0.3
    assert not hasattr(proposer.first, "fallback")
    alone = build_proposer(None, 10, free_drafts=free_drafts)
    assert isinstance(alone, kind)  # no draft model: the free drafts alone
    assert isinstance(build_proposer(backend, 10), DraftModelProposer)
    assert build_proposer(None, 10) is None
    with pytest.raises(ValueError, match="free_drafts must be"):
        build_proposer(backend, 10, free_drafts=True)


def test_free_drafts_go_to_the_device_asked_for_else_the_draft_models():
    backend = TableModel(10, seed=3)
    proposer = build_proposer(backend, 10, free_drafts="ngram")
    proposer.add_row([1, 2, 1, 2])
    [draft] = proposer.propose(rows([1, 2, 1, 2]), [2])
    assert draft.lookup and draft.tokens.tolist() == [1, 2] and proposer.first.device == backend.device
    assert build_proposer(None, 10, free_drafts="suffix", device="meta").device == torch.device("meta")
    assert build_proposer(backend, 10, free_drafts="ngram", device="meta").first.device == torch.device("meta")
