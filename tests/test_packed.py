"""float32 linears with oneDNN-packed weights (models/packed.py): the same float32 products, the
same logits through ragged rows and rollback, and speculative greedy equal to plain greedy."""

import copy

import pytest
import torch

from helpers import PROMPT, single_row_logits, tiny_llama
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import HFCausalLM, packed
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 64), (1, 150, 64)])
def test_packed_linear_is_the_float32_product(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape)
    exact = (x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)).float()
    out = packed.PackedLinear(linear)(x)
    assert out.shape == (*shape[:-1], 96) and out.dtype == torch.float32
    # float32 rounding, as torch's own float32 linear: not bfloat16 or TF32 arithmetic (~1e-3)
    assert (out - exact).abs().max() < 1e-5
    assert (linear(x) - exact).abs().max() < 1e-5


def test_packed_model_gives_the_same_logits_through_rows_and_rollback():
    model = tiny_llama(3, hidden=64)
    packed_model = copy.deepcopy(model)
    assert packed.pack_linears(packed_model) == 2 * 7 + 1  # 7 projections per layer and the head
    assert not any(type(m) is torch.nn.Linear for m in packed_model.modules())
    plain, fast = HFCausalLM(model), HFCausalLM(packed_model)
    sequence = PROMPT + [9, 4, 60, 1]
    assert torch.allclose(single_row_logits(fast, sequence, 5), single_row_logits(plain, sequence, 5), atol=1e-5)
    for backend in (plain, fast):  # two ragged rows, then a rollback and a new feed
        backend.reset()
        backend.add_row()
        backend.add_row()
        backend.forward([PROMPT, PROMPT[:3]], 1)
        backend.truncate([4, 2])
    assert torch.allclose(fast.forward([[7, 8], [9]], 2), plain.forward([[7, 8], [9]], 2), atol=1e-5)


def test_speculative_greedy_with_a_packed_target_equals_plain_greedy():
    target = tiny_llama(5, hidden=64)
    packed.pack_linears(target)
    draft = tiny_llama(6, hidden=64)
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0), num_speculative_tokens=4)
    plain = run(HFCausalLM(target), None, PROMPT, config)
    spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(draft)), PROMPT, config)
    assert spec.token_ids == plain.token_ids and spec.stats.num_drafted > 0
    # a wrong packing (a transposed weight) would not reproduce the unpacked model's greedy text
    unpacked = run(HFCausalLM(tiny_llama(5, hidden=64)), None, PROMPT, config)
    assert plain.token_ids == unpacked.token_ids


def test_packing_frees_each_dense_weight_before_the_next_layer_is_packed(monkeypatch):
    # the peak of packing a model is one layer's two copies, not the model's (a 1.5B float32
    # target peaked at 13.5 GB while a list of every module kept the dense weights alive)
    import weakref

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)],
                                torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()))
    dense, alive, pack = [], [], packed.PackedLinear.__init__

    def watched(self, linear, rows_hint=9):
        alive.append(sum(ref() is not None for ref in dense))
        dense.append(weakref.ref(linear))
        pack(self, linear, rows_hint)

    monkeypatch.setattr(packed.PackedLinear, "__init__", watched)
    assert packed.pack_linears(model) == 5
    assert alive == [0] * 5 and all(ref() is None for ref in dense)


def test_pack_linears_refuses_a_bfloat16_model():
    with pytest.raises(ValueError, match="float32"):
        packed.pack_linears(tiny_llama(1).to(torch.bfloat16))


def test_one_row_calls_without_onednn_give_the_bfloat16_logits_and_leave_onednn_on():
    model = tiny_llama(7, hidden=64).to(torch.bfloat16)
    default, gemv = HFCausalLM(model), HFCausalLM(model)
    gemv.one_row_onednn = False
    for backend in (default, gemv):
        backend.reset()
        backend.add_row()
        backend.forward([PROMPT], 1)
    one, other = default.forward([[9]], 1), gemv.forward([[9]], 1)
    assert torch.allclose(one, other, atol=0.05, rtol=0.02)  # bfloat16 rounding of another kernel
    assert torch.backends.mkldnn.enabled  # switched back after the call


def test_wide_upcast_linear_reads_many_rows_as_float32_products_of_the_bfloat16_values():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    wide = packed.WideUpcastLinear(linear, min_rows=8)
    few, many = torch.randn(1, 3, 64).bfloat16(), torch.randn(2, 20, 64).bfloat16()
    assert torch.equal(wide(few), linear(few))  # under min_rows: the bfloat16 kernel itself
    exact = (many.double() @ linear.weight.double().T + linear.bias.double()).to(torch.bfloat16)
    out = wide(many)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 20, 96)
    # float32 accumulation rounded once to bfloat16: at most one bfloat16 step from the exact value
    assert ((out.float() - exact.float()).abs() <= exact.float().abs() * 2 ** -7 + 1e-6).all()
    assert torch.allclose(out.float(), linear(many).float(), atol=0.02, rtol=0.02)


def test_upcast_wide_linears_keeps_the_model_s_greedy_text():
    model = tiny_llama(8, hidden=64).to(torch.bfloat16)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0), num_speculative_tokens=0)
    before = run(HFCausalLM(model), None, PROMPT * 6, config)  # a 42-token prompt read: upcast
    assert packed.upcast_wide_linears(model, min_rows=16) == 2 * 7 + 1
    assert packed.upcast_wide_linears(model, min_rows=16) == 0  # already wrapped
    after = run(HFCausalLM(model), None, PROMPT * 6, config)
    assert after.token_ids == before.token_ids
