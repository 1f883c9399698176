"""Backends score a token tree in one forward (tree attention mask, per-node positions), and after
verification keep exactly the accepted path: the cache then continues as if only the path had
ever been fed, also when a side branch won."""

import pytest
import torch

from specdecode.models import HFCausalLM, TableModel

from helpers import single_row_logits, tiny_llama, tiny_mistral

# root → nodes 0 and 1; node 0 → 2 and 3; node 3 → 4; node 1 → 5
TOKENS = [11, 12, 21, 22, 31, 23]
PARENTS = [-1, -1, 0, 0, 3, 1]


def paths(tokens, parents):
    out = []
    for i in range(len(tokens)):
        node, path = i, []
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        out.append(path[::-1])
    return out


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(0)


def make(kind, llama):
    return HFCausalLM(llama) if kind == "hf" else TableModel(40, order=3, seed=3)


def logits_alone(kind, llama, sequence, n):
    if kind == "table":
        model = TableModel(40, order=3, seed=3)
        return torch.stack([model.logits_for(sequence[:len(sequence) - n + 1 + j]) for j in range(n)])
    return single_row_logits(HFCausalLM(llama), sequence, n)


@pytest.mark.parametrize("kind", ["hf", "table"])
def test_tree_forward_scores_every_node_as_its_own_path(kind, llama):
    # Two rows: row 0 reads a plain ragged feed, row 1 a pending token and a tree. Float32: 1e-4.
    backend = make(kind, llama)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    for prompt in prompts:
        backend.add_row()
    backend.forward([p[:-1] for p in prompts], 1)
    width = len(TOKENS) + 1
    logits = backend.forward([[9, 1, 2], [4] + TOKENS], width, trees=[None, PARENTS])
    expected_plain = logits_alone(kind, llama, [5, 6, 7, 8, 9, 1, 2], 3)
    assert torch.allclose(logits[0, -3:], expected_plain, atol=1e-4)
    assert torch.allclose(logits[1, 0], logits_alone(kind, llama, [3, 4], 1)[0], atol=1e-4)
    for i, path in enumerate(paths(TOKENS, PARENTS)):
        assert torch.allclose(logits[1, i + 1], logits_alone(kind, llama, [3, 4] + path, 1)[0], atol=1e-4), i
    assert backend.lengths == [7, 2 + len(TOKENS)]


@pytest.mark.parametrize("kind", ["hf", "table"])
@pytest.mark.parametrize("path", [[1, 5], [0, 3, 4], [], [1]], ids=["side-branch", "main", "none", "side-leaf"])
def test_after_keeping_a_path_the_cache_holds_exactly_it(kind, path, llama):
    backend = make(kind, llama)
    backend.add_row()
    backend.add_row()
    backend.forward([[5, 6, 7], [3]], 1)
    backend.forward([[8], [4] + TOKENS], len(TOKENS) + 1, trees=[None, PARENTS])
    backend.keep_tree_paths([None, path])
    committed = [3, 4] + [TOKENS[i] for i in path]
    assert backend.lengths == [4, len(committed)]
    # the engine then drops the last token it will feed again, and the next step continues
    backend.truncate([4, len(committed) - 1])
    logits = backend.forward([[9, 10], [committed[-1], 17, 18]], 3)
    assert torch.allclose(logits[0, -2:], logits_alone(kind, llama, [5, 6, 7, 8, 9, 10], 2), atol=1e-4)
    assert torch.allclose(logits[1], logits_alone(kind, llama, committed + [17, 18], 3), atol=1e-4)
    assert backend.lengths == [6, len(committed) + 2]


def test_keep_tree_paths_refuses_a_row_without_a_tree_and_a_node_not_in_it(llama):
    backend = HFCausalLM(llama)
    backend.add_row()
    backend.forward([[3, 4] + TOKENS], 1, trees=[PARENTS])
    with pytest.raises(ValueError, match="path"):
        backend.keep_tree_paths([[0, 9]])
    with pytest.raises(ValueError, match="tree"):
        HFCausalLM(llama).keep_tree_paths([[0]])


def test_a_single_row_is_dense_again_after_a_side_branch_wins(llama):
    # the kept path is moved next to the prefix, so the row has no holes and needs no mask
    backend = HFCausalLM(llama)
    backend.add_row()
    backend.forward([[3, 4] + TOKENS], 1, trees=[PARENTS])
    backend.keep_tree_paths([[1, 5]])
    assert backend.lengths == [4] and backend.num_slots == 4 and bool(backend.valid.all())
    backend.truncate([3])  # as the engine does: the last token is fed again with the next step
    logits = backend.forward([[TOKENS[5], 17]], 2)
    assert torch.allclose(logits[0], logits_alone("hf", llama, [3, 4, TOKENS[1], TOKENS[5], 17], 2), atol=1e-4)


def test_a_single_row_tree_gets_the_tree_mask_too(llama):
    # one row is dense (no mask on its plain path): a tree must still switch the mask on
    backend = HFCausalLM(llama)
    backend.add_row()
    logits = backend.forward([[3, 4] + TOKENS], len(TOKENS) + 1, trees=[PARENTS])
    for i, path in enumerate(paths(TOKENS, PARENTS)):
        assert torch.allclose(logits[0, i + 1], logits_alone("hf", llama, [3, 4] + path, 1)[0], atol=1e-4), i


def test_a_sliding_window_model_refuses_trees():
    backend = HFCausalLM(tiny_mistral(0, layers=1))
    backend.add_row()
    with pytest.raises(ValueError, match="sliding-window"):
        backend.forward([[3, 4, 5, 6]], 1, trees=[[-1, -1]])
