"""Tiny random GGUF files for tests and the llama.cpp benchmark's smoke run: a byte-level BPE
vocabulary trained on a few lines, a random Qwen2-architecture model, and both written as an F32
GGUF file with the gguf package (llama.cpp's tensor names, a ChatML template). No network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_CORPUS = ("def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog. "
               "print('hello world')\nfor i in range(10):\n    print(i)\n") * 4
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_vocabulary(size: int = 320) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained on a few lines of code and prose: the 256 byte
    symbols, merges up to `size` ids, then the ChatML special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size - len(TINY_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TINY_CORPUS], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens + TINY_SPECIALS, merges


def tiny_qwen2(seed: int, vocab: int, layers: int = 2, hidden: int = 64, head_scale: float = 3.0):
    """A random float32 Qwen2ForCausalLM (4 heads, 2 KV heads, biases on q/k/v) whose logits have
    a spread of about head_scale (peaked enough that greedy decoding rarely meets a near-tie)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2:
                weight.normal_(0, (head_scale if name == "lm_head.weight" else 1.0) / weight.shape[1] ** 0.5)
            elif name.endswith("bias"):
                weight.normal_(0, 0.1)
            else:  # norms
                weight.copy_(1 + 0.1 * torch.randn_like(weight))
    return model


def write_gguf(model, tokens: list[str], merges: list[str], path: Path, tied: bool = False) -> None:
    """A Qwen2ForCausalLM and its byte-level BPE vocabulary as an F32 GGUF file (llama.cpp's
    tensor names; qwen2's rotary layout needs no permutation), with a ChatML template. tied: no
    output matrix (readers then tie the LM head to the token embeddings)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in TINY_SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, weight in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), weight.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_tiny(root: Path, vocab: int = 320) -> dict[str, Path]:
    """{"target", "draft"}: F32 GGUF files in root, written once. The draft is the target with
    every weight perturbed by noise (a tenth of its spread), so it agrees with the target
    often but not always."""
    root = Path(root)
    paths = {name: root / f"tiny-{name}-f32.gguf" for name in ("target", "draft")}
    if all(path.is_file() for path in paths.values()):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    tokens, merges = tiny_vocabulary(vocab)
    target = tiny_qwen2(0, len(tokens))
    draft = tiny_qwen2(0, len(tokens))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.1 * weight.std().clamp(min=0.05))
    for name, model in (("target", target), ("draft", draft)):
        partial = paths[name].with_suffix(".partial")
        write_gguf(model, tokens, merges, partial)
        partial.replace(paths[name])
    return paths
