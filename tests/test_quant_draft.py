"""Preparing a draft for the int8/int4 kernels: dtypes they refuse, and the on-disk cache of a
quantized zoo draft (it must give exactly the logits of a freshly quantized one)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdecode import SpeculativeDecoder
from specdecode.models.quant import prepare_draft


def tiny_llama(seed=0, vocab=96, dtype=torch.float32):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_float64_draft_is_refused_before_quantizing_naming_the_dtype(bits):
    draft = tiny_llama(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"torch\.float64: .*float32, bfloat16 or float16.*quantize_draft='none'"):
        prepare_draft(draft, bits)
    assert isinstance(draft.lm_head, torch.nn.Linear)  # refused before any layer was replaced


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_dtypes_are_accepted(dtype):
    draft = prepare_draft(tiny_llama(dtype=dtype), 4)
    assert draft(torch.tensor([[5, 17, 33]])).logits.dtype == dtype


def test_the_decoder_refuses_a_float64_draft_to_quantize_at_construction(char_tokenizer):
    target = tiny_llama(0, vocab=len(char_tokenizer))
    draft = tiny_llama(1, vocab=len(char_tokenizer), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"draft whose linear layers are torch\.float64"):
        SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, quantize_draft="int4", guard=False)
    assert SpeculativeDecoder(target, draft, tokenizer=char_tokenizer, guard=False).draft is not None  # unquantized
