"""A transformers causal LM that owns its KV cache (one sequence)."""

from __future__ import annotations

import torch

from specdecode.models.quant import QUANTIZED_LINEAR


def limited_head(model, vocab_limit: int | None):
    """(a function hidden [..., H] → logits of the first vocab_limit ids, or None for the model's
    own head; V). Works for float and int8/int4 heads.

    Raises:
        ValueError: vocab_limit on a model whose LM head is not a plain linear layer.
    """
    head = model.get_output_embeddings()
    vocab_size = head.out_features  # nn.Linear and the quantized layers alike
    if vocab_limit is None or vocab_limit >= vocab_size:
        return None, vocab_size
    scaled = any(getattr(model.config, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if not isinstance(head, (torch.nn.Linear, *QUANTIZED_LINEAR)) or head.bias is not None or scaled:
        raise ValueError(f"vocab_limit needs a plain linear LM head; {type(model).__name__} has another")
    # Views of the first rows: no copy, and the user's model is untouched.
    if isinstance(head, QUANTIZED_LINEAR):
        return head.first_rows(vocab_limit), vocab_limit
    weight = head.weight[:vocab_limit]
    return (lambda hidden: torch.nn.functional.linear(hidden, weight)), vocab_limit


class HFCausalLM:
    """Wraps a transformers `PreTrainedModel` (decoder-only) with a DynamicCache and exact rollback.

    Args:
        model: a loaded causal LM; it is put in eval mode, never otherwise modified.
        vocab_limit: score only token ids below this (for a draft model: the LM head of a small
            model is a large share of its cost). BPE vocabularies put frequent tokens first, so
            a draft that never proposes rare ids loses little acceptance; its q is zero there,
            and the verifier stays exact (DESIGN.md rule 6). None scores the whole vocabulary.
    Attributes:
        vocab_size: V, the width of the logits (the embedding table's size, which may exceed
            the tokenizer's length: rule 6), or vocab_limit.
        max_length: the model's context window (max_position_embeddings), or None.
    Raises:
        ValueError: vocab_limit on a model whose LM head is not a plain linear layer.
    """

    def __init__(self, model, vocab_limit: int | None = None):
        from transformers import DynamicCache

        self.model = model.eval()
        self._cache_class = DynamicCache
        self._head, self.vocab_size = limited_head(model, vocab_limit)
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self.cache = self._cache_class(config=self.model.config)
        # Sliding-window layers drop states past the window unless told to keep them, and then a
        # rollback past the window would be impossible.
        for layer in getattr(self.cache, "layers", []):
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self._length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Append tokens [T] int64; return the next-token logits after each of the last
        `num_logits` of them, [num_logits, V] float32 (the LM head runs only there)."""
        if self._head is not None:
            hidden = self.model.get_decoder()(input_ids=tokens.view(1, -1), cache=self.cache,
                                              use_cache=True).last_hidden_state
            self._length += tokens.numel()
            return self._head(hidden[0, -num_logits:]).float()
        out = self.model(input_ids=tokens.view(1, -1), cache=self.cache, use_cache=True,
                         logits_to_keep=num_logits)
        self._length += tokens.numel()
        return out.logits[0].float()

    def truncate(self, length: int) -> None:
        """Drop every cache entry past `length` tokens (rejected drafts)."""
        if length <= self._length:
            # transformers 5 takes a negative count to drop; crop(0) still trims the recorded
            # states of sliding-window layers back to their window.
            self.cache.crop(length - self._length)
            self._length = length
