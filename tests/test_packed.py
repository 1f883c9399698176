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
    assert torch._C._get_mkldnn_enabled()  # switched back after the call
