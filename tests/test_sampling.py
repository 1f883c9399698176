import math
import re

import numpy as np
import pytest
import torch

from specdecode.sampling import SamplingParams, adjust, make_generator


def test_greedy_is_one_hot_on_argmax_lowest_index_wins_ties():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0]])
    probs = adjust(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert probs.dtype == torch.float32


def test_temperature_is_softmax_of_scaled_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = adjust(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_most_likely_and_renormalizes():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    probs = adjust(logits, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    # 0.4 + 0.3 = 0.7 reaches 0.7: exactly two tokens kept
    assert torch.allclose(adjust(logits, SamplingParams(top_p=0.7)), torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # 0.71 needs a third token
    assert torch.allclose(adjust(logits, SamplingParams(top_p=0.71)), torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9]))
    # a tiny top_p keeps only the top token
    assert adjust(logits, SamplingParams(top_p=0.01)).tolist() == [0.0, 1.0, 0.0, 0.0]
    # also one that rounds to 0 in float32 (it dropped every token: NaN)
    for tiny in (1e-46, 5e-324):
        assert adjust(logits, SamplingParams(top_p=tiny)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    probs = adjust(logits, SamplingParams(min_p=0.4))  # threshold 0.16
    assert torch.allclose(probs, torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9]))


def test_filters_apply_per_row_in_a_batch():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))
    probs = adjust(logits, SamplingParams(temperature=0.7, top_k=10, top_p=0.8))
    assert probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5))
    assert ((probs > 0).sum(-1) <= 10).all()


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0), dict(min_p=-0.1)])
def test_bad_sampling_params_raise(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{name} must be .*, got {value}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-50, 2.0 ** -150])
def test_a_temperature_that_rounds_to_zero_in_float32_is_greedy(temperature):
    # below 2**-150 ≈ 7e-46 float32 holds 0, and dividing by it gave NaN probabilities
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert torch.equal(adjust(logits, params), adjust(logits, SamplingParams(temperature=0)))


def test_the_smallest_float32_temperature_still_samples_without_nan():
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    params = SamplingParams(temperature=1e-45)  # the smallest positive float32 (a subnormal)
    assert not params.greedy
    assert adjust(logits, params).tolist() == [0.0, 0.5, 0.5, 0.0]  # the limit T → 0 of softmax


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.5"), ("temperature", True), ("temperature", None), ("top_k", 2.0), ("top_k", True),
    ("top_k", "3"), ("top_p", "0.9"), ("top_p", False), ("min_p", [0.1]), ("seed", 1.5), ("seed", True),
    ("seed", "7")])
def test_a_field_of_the_wrong_type_raises_a_type_error_naming_it(field, value):
    with pytest.raises(TypeError, match=rf"^{field} must be .*got {re.escape(repr(value))} \("):
        SamplingParams(**{field: value})


def test_ints_are_numbers_and_numpy_scalars_are_stored_as_python_numbers():
    params = SamplingParams(temperature=1, top_p=1, min_p=0, top_k=np.int64(3), seed=np.int64(5))
    assert params == SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0, top_k=3, seed=5)
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.seed) is int
    assert type(SamplingParams(temperature=np.float32(0.5)).temperature) is float
    make_generator(params.seed)  # torch's manual_seed refuses numpy integers


def test_first_argmax_is_torchs_argmax_with_the_lowest_id_on_ties():
    from specdecode.sampling import first_argmax

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 1000, generator=generator)
    x[0, 0, [7, 3, 900]] = 50.0            # a tie: the lowest id wins
    x[1, 2, :] = 0.0                       # all equal: id 0
    x[2, 4, [10, 20]] = float("inf")
    for t in (x, x[0, 0], x.transpose(0, 1), x.double(), x.bfloat16()):
        assert torch.equal(first_argmax(t), t.argmax(-1)), t.dtype
    assert first_argmax(x)[0, 0] == 3 and first_argmax(x)[1, 2] == 0 and first_argmax(x)[2, 4] == 10
    assert first_argmax(x).dtype == torch.int64 and first_argmax(x[0, 0]).shape == ()
