"""The draft's lean forward (models/lean.py) against transformers' forward, through HFCausalLM:
the same logits (float32 rounding) for prompt reads, ragged rows, masks, token trees, rollback and
row selection, on a tiny Llama, a tiny Qwen2 (q/k/v biases) and their int4 versions (fused
projections); and the models it must refuse."""

import copy

import pytest
import torch

from helpers import tiny_llama, tiny_mistral
from specdecode.models import HFCausalLM
from specdecode.models import lean
from specdecode.models.quant import Int4Linear, prepare_draft


def tiny_qwen2(seed, layers=2, hidden=64, vocab=96):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                         use_sliding_window=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases: a fused q|k|v must add each to its own part
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def int4(model):
    """The model as the library prepares a draft: int4 layers and eager attention."""
    return prepare_draft(copy.deepcopy(model), bits=4)


MODELS = {"llama": lambda: tiny_llama(11, hidden=64), "qwen2": lambda: tiny_qwen2(12),
          "llama-int4": lambda: int4(tiny_llama(13, hidden=128)), "qwen2-int4": lambda: int4(tiny_qwen2(14, hidden=128))}


def pair(model, vocab_limit=None):
    """(transformers' forward, the lean forward) over the same model."""
    plain, fast = HFCausalLM(model, vocab_limit), HFCausalLM(model, vocab_limit, lean=True)
    assert plain._lean is None and fast._lean is not None
    return plain, fast


def both(backends, method, *args):
    return [getattr(b, method)(*args) for b in backends]


def assert_close(outputs, atol=2e-5):
    torch.testing.assert_close(outputs[1], outputs[0], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_lean_forward_gives_transformers_logits_through_rows_trees_and_rollback(name):
    model = MODELS[name]()
    backends = pair(model, vocab_limit=80)
    assert backends[1]._lean.eager == name.endswith("int4")  # SDPA for the float models
    if name.endswith("int4"):  # the fused layers are int4 too
        assert isinstance(backends[1]._lean.layers[0].qkv, Int4Linear)
        assert isinstance(backends[1]._lean.layers[0].gate_up, Int4Linear)
        # the kernel's packed copy, concatenated from the layers' own, equals a fresh packing
        for fused in (backends[1]._lean.layers[0].qkv, backends[1]._lean.layers[0].gate_up):
            repacked = Int4Linear.from_buffers(fused.nibbles, fused.scale_zero, None, fused.group_size)
            assert torch.equal(fused.packed, repacked.packed)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 96, (n,), generator=gen).tolist()  # noqa: E731
    both(backends, "add_row", None, ids(9))                 # a prompt read alone (fill)
    both(backends, "add_row", None, ids(4))
    both(backends, "add_row")
    assert_close(both(backends, "forward", [ids(1), ids(3), ids(5)], 5))   # ragged: masks
    assert_close(both(backends, "forward", [ids(1), ids(1), ids(1)], 1))   # one token a row
    assert_close(both(backends, "forward", [ids(4), ids(4), ids(4)], 4))   # dense: causal
    both(backends, "truncate", [b.lengths[0] - 2 for b in backends[:1]] + [3, 6])  # rejected drafts leave
    assert backends[0].lengths == backends[1].lengths
    trees = [[-1, 0, 0, 1], None, [-1, -1]]
    assert_close(both(backends, "forward", [ids(4), ids(2), ids(3)], 4, trees))
    both(backends, "keep_tree_paths", [[0, 1], None, [1]])
    assert_close(both(backends, "forward", [ids(2), ids(1), ids(2)], 2))
    both(backends, "select", [2, 0])                         # a row finished
    assert_close(both(backends, "forward", [ids(3), ids(1)], 3))


def test_an_eager_draft_reads_a_wide_feed_with_sdpa_and_the_same_logits(monkeypatch):
    model = int4(tiny_qwen2(15, hidden=128))
    backends = pair(model, vocab_limit=80)
    wide = list(range(3, 3 + 3 * lean.EAGER_MAX_WIDTH))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(lean.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape[2]) or sdpa(*a, **k))
    both(backends, "add_row", None, wide)  # a prompt read wider than EAGER_MAX_WIDTH
    both(backends, "add_row")
    assert_close(both(backends, "forward", [[1], wide], 2))
    assert calls and min(calls) > lean.EAGER_MAX_WIDTH  # the wide calls only: narrow ones stay eager
    assert_close(both(backends, "forward", [[4], [5]], 1))
    assert max(calls) == len(wide) and len(calls) == 2 * len(model.model.layers)


def test_lean_forward_without_a_vocab_limit_uses_the_models_head():
    backends = pair(tiny_qwen2(3))
    both(backends, "add_row", None, [1, 2, 3])
    assert_close(both(backends, "forward", [[4, 5]], 2))


@pytest.mark.parametrize("make, why", [
    (lambda: tiny_mistral(1, 1), "mistral"),
    (lambda: _with_rope(tiny_llama(1), {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "scaled rope"),
])
def test_models_the_lean_forward_does_not_reproduce_keep_transformers_forward(make, why):
    model = make()
    assert not lean.supports(model), why
    assert HFCausalLM(model, lean=True)._lean is None


def _with_rope(model, parameters):
    model.config.rope_parameters = parameters
    return model


def test_a_target_keeps_transformers_forward_and_a_draft_gets_the_lean_one(model_dirs):
    from specdecode import SpeculativeDecoder

    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False)
    assert decoder.target.backend._lean is None
    assert decoder.draft.backend._lean is not None
