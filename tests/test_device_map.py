"""SpeculativeDecoder(device_map=...): the target placed by transformers/accelerate, the draft on
the target's first device, the same greedy text as without (tiny float32 models on the CPU; on a
machine with CUDA, also a target split between the GPU and the CPU)."""

import pytest
import torch

from specdecode import SamplingParams, SpeculativeDecoder

pytest.importorskip("accelerate")
GREEDY = SamplingParams(temperature=0)
PROMPTS = ["abc", "the cafe", "dead beef"]


def texts(decoder):
    return [r.text for r in decoder.generate(PROMPTS, max_new_tokens=16, sampling=GREEDY, chat=False)]


@pytest.fixture(scope="module")
def plain_texts(model_dirs):
    return texts(SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False))


def test_device_map_auto_keeps_the_greedy_text_and_the_draft_on_the_first_device(model_dirs, plain_texts):
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False,
                                 device_map="auto")
    assert decoder.pair.device == torch.device("cpu") == next(decoder.draft.backend.model.parameters()).device
    assert texts(decoder) == plain_texts


# the last layer and the head offloaded to disk: accelerate's hooks load them for each forward
OFFLOADED = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
             "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}


def test_a_target_offloaded_to_disk_by_its_device_map_keeps_the_greedy_text(model_dirs, plain_texts, tmp_path):
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False,
                                 device_map=OFFLOADED, offload_folder=str(tmp_path / "offload"))
    model = decoder.target.backend.model
    assert model.hf_device_map == OFFLOADED  # passed through to transformers and accelerate
    assert model.lm_head.weight.device == torch.device("meta")  # its weights stay on disk between forwards
    assert decoder.pair.device == torch.device("cpu")
    assert texts(decoder) == plain_texts


def test_device_map_with_device_or_a_loaded_target_is_refused(model_dirs, char_tokenizer):
    with pytest.raises(ValueError, match="device_map places a target loaded by name or path"):
        SpeculativeDecoder(model_dirs["target"], None, device="cpu", device_map="auto")
    from helpers import tiny_llama

    with pytest.raises(ValueError, match="device_map"):
        SpeculativeDecoder(tiny_llama(0, vocab=len(char_tokenizer)), None, tokenizer=char_tokenizer, device_map="auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_target_split_between_gpu_and_cpu_keeps_the_greedy_text(model_dirs, plain_texts):
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
             "model.norm": "cpu", "lm_head": "cpu"}
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False,
                                 device_map=split)
    assert decoder.pair.device == torch.device("cuda", 0)
    assert next(decoder.draft.backend.model.parameters()).device == torch.device("cuda", 0)
    assert texts(decoder) == plain_texts
