"""Token trees: the multi-draft rule over siblings is exact (the emitted tokens follow p), accepts
at least as often as one draft, and reduces to "follow the target's argmax" when greedy."""

import itertools
from collections import Counter

import pytest
import torch

from specdecode.models import TableModel
from specdecode.sampling import SamplingParams, adjust
from specdecode.verify import acceptance_probs, residual_distribution, tree_step

from helpers import chi2_pvalue, random_probs, target_sequence_probs


def tree_outcomes(tokens, parents, q, p, residual=residual_distribution):
    """Exact {(path, next token): prob} of tree_step's walk, from the rule's public pieces.
    tokens: N ints; q [N, V]; p [N+1, V]."""
    out = Counter()
    children = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)

    def visit(node, path, prob):
        r = p[node + 1].double()
        for child in children.get(node, []):
            a = float(acceptance_probs(torch.tensor([[tokens[child]]]), q[child].view(1, 1, -1),
                                       r.float().view(1, 1, -1))[0, 0])
            if a > 0:
                visit(child, path + (child,), prob * a)
            prob *= 1 - a
            r = residual(r.float(), q[child]).double()
        for y in range(p.shape[-1]):
            if prob * r[y] > 0:
                out[(path, y)] += prob * float(r[y])

    visit(-1, (), 1.0)
    return out


def test_two_iid_branches_emit_p_and_accept_at_least_sum_min():
    # The case: p = [0.2, 0.3, 0.5], q = [0.6, 0.3, 0.1], two children of the root drawn
    # i.i.d. from q; enumerate both draws and every outcome.
    p, q = torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.6, 0.3, 0.1])
    first = torch.zeros(3, dtype=torch.float64)
    accepted = 0.0
    for c1, c2 in itertools.product(range(3), repeat=2):
        draws = float(q[c1] * q[c2])
        probs = torch.stack([p, p, p])  # p after each child: unused for the first token
        for (path, y), prob in tree_outcomes([c1, c2], [-1, -1], torch.stack([q, q]), probs).items():
            token = [c1, c2][path[0]] if path else y
            first[token] += draws * prob
            accepted += draws * prob * bool(path)
    assert torch.allclose(first, p.double(), atol=1e-6)
    single = float(torch.minimum(p, q).sum())  # 0.6
    # After a rejection the residual is one-hot on token 2, which the second draw hits with q = 0.1:
    # 0.6 + 0.4 · 0.1.
    assert accepted > single and accepted == pytest.approx(0.64, abs=1e-6)


def test_enumeration_detects_a_residual_that_forgets_the_rejected_sibling():
    # Power: resampling a rejected node from p (not the residual) breaks exactness by > 1e-2.
    p, q = torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.6, 0.3, 0.1])
    first = torch.zeros(3, dtype=torch.float64)
    for c1, c2 in itertools.product(range(3), repeat=2):
        outcomes = tree_outcomes([c1, c2], [-1, -1], torch.stack([q, q]), torch.stack([p, p, p]),
                                 residual=lambda r, q_: r)
        for (path, y), prob in outcomes.items():
            first[[c1, c2][path[0]] if path else y] += float(q[c1] * q[c2]) * prob
    assert (first - p.double()).abs().max() > 1e-2


def chain_with_leaves(target, draft, prefix, params, depth, siblings, vocab):
    """Every draw of a tree whose main chain has `depth` nodes, each chain node with `siblings`
    extra leaf siblings drawn i.i.d. from the same q: yields (prob, tokens, parents, q, p)."""
    def grow(level, chain_prefix, tokens, parents, qs, parent):
        if level == depth:
            yield 1.0, tokens, parents, qs
            return
        q = adjust(draft.logits_for(prefix + chain_prefix), params)
        for draws in itertools.product(range(vocab), repeat=1 + siblings):
            prob = float(torch.prod(q[list(draws)]))
            if prob == 0:
                continue
            base = len(tokens)
            new_tokens = tokens + list(draws)
            new_parents = parents + [parent] * len(draws)
            for rest, t, pa, qq in grow(level + 1, chain_prefix + [draws[0]], new_tokens, new_parents,
                                        qs + [q] * len(draws), base):
                yield prob * rest, t, pa, qq

    for prob, tokens, parents, qs in grow(0, [], [], [], [], -1):
        paths = []
        for i in range(len(tokens)):
            node, path = i, []
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            paths.append(path[::-1])
        p = torch.stack([adjust(target.logits_for(prefix), params)]
                        + [adjust(target.logits_for(prefix + path), params) for path in paths])
        yield prob, tokens, parents, torch.stack(qs), p


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=2),
                                    SamplingParams(temperature=0)], ids=["t1", "t0.7-topk2", "greedy"])
def test_tree_walk_emits_the_target_sequence_distribution(params):
    # Context-dependent tables, vocab 3: a chain of 2 with one i.i.d. sibling leaf at each depth.
    # The emitted tokens (path + next), continued by the target, follow p over 3 tokens to 1e-6.
    target, draft = TableModel(3, order=2, seed=10), TableModel(3, order=2, seed=11)
    prefix, length = [0, 1], 3
    got = Counter()
    for prob, tokens, parents, q, p in chain_with_leaves(target, draft, prefix, params, 2, 1, 3):
        for (path, y), outcome in tree_outcomes(tokens, parents, q, p).items():
            emitted = [tokens[i] for i in path] + [y]
            rest = length - len(emitted)
            for tail, tail_prob in target_sequence_probs(target, prefix + emitted, rest, params).items() \
                    if rest > 0 else [((), 1.0)]:
                got[tuple(emitted + list(tail))] += prob * outcome * tail_prob
    expected = target_sequence_probs(target, prefix, length, params)
    for seq, prob in expected.items():
        assert abs(got.get(seq, 0.0) - prob) < 1e-6, (seq, got.get(seq, 0.0), prob)


@pytest.mark.slow
def test_tree_step_samples_the_walk_chi_square():
    # tree_step on 20k draws of the two-branch tree (seed 6): the joint (path, next token)
    # against the exact enumeration, significance 1e-4.
    p, q = torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.6, 0.3, 0.1])
    p_after = random_probs((2, 3), torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(6)
    exact, counts = Counter(), Counter()
    for c1, c2 in itertools.product(range(3), repeat=2):
        probs = torch.stack([p, p_after[0], p_after[1]])
        for (path, y), prob in tree_outcomes([c1, c2], [-1, -1], torch.stack([q, q]), probs).items():
            exact[(c1, c2, path, y)] += float(q[c1] * q[c2]) * prob
    for _ in range(20_000):
        c1, c2 = torch.multinomial(q, 2, replacement=True, generator=g).tolist()
        probs = torch.stack([p, p_after[0], p_after[1]])
        path, y, _ = tree_step(torch.tensor([c1, c2]), [-1, -1], torch.stack([q, q]), probs, g)
        counts[(c1, c2, tuple(path), y)] += 1
    keys = sorted(exact)
    assert sum(counts[k] for k in keys) == 20_000
    assert chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys]) > 1e-4


def test_greedy_tree_follows_the_targets_argmax_path():
    # one-hot p and q: the walk takes the child equal to the target's argmax, whichever sibling it is
    v = 6
    eye = torch.eye(v)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    parents = [-1, -1, 1, 1, 0]  # root → {1, 2}; node 1 (token 2) → {3, 4}; node 0 (token 1) → {5}
    q = eye[tokens]
    # target: argmax 2 at the root (the second sibling), then 4 (node 3), then 0 after it
    p = torch.stack([eye[2], eye[0], eye[4], eye[1], eye[0], eye[3]])
    path, token, rejected = tree_step(tokens, parents, q, p)
    assert (path, token, rejected) == ([1, 3], 0, False)
    p[4] = eye[5]  # after node 3 the target wants 5: no child there, so 5 is the bonus token
    assert tree_step(tokens, parents, q, p)[:2] == ([1, 3], 5)
    p[2] = eye[0]  # after node 1 the target wants 0: neither child, a correction
    assert tree_step(tokens, parents, q, p) == ([1], 0, True)


def test_tree_step_rejects_bad_trees():
    with pytest.raises(ValueError, match="earlier node"):
        tree_step(torch.tensor([1, 2]), [-1, 1], torch.full((2, 3), 1 / 3), torch.full((3, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"\(2,\), 2, \(2, 3\), \(2, 3\)"):
        tree_step(torch.tensor([1, 2]), [-1, 0], torch.full((2, 3), 1 / 3), torch.full((2, 3), 1 / 3))
