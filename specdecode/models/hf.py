"""A transformers causal LM that owns its KV cache (one sequence)."""

from __future__ import annotations

import torch


class HFCausalLM:
    """Wraps a transformers `PreTrainedModel` (decoder-only) with a DynamicCache and exact rollback.

    Args:
        model: a loaded causal LM; it is put in eval mode, never otherwise modified.
    Attributes:
        vocab_size: V, the width of the logits (the embedding table's size, which may exceed
            the tokenizer's length: rule 6).
        max_length: the model's context window (max_position_embeddings), or None.
    """

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model.eval()
        self._cache_class = DynamicCache
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self.cache = self._cache_class(config=self.model.config)
        self._length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Append tokens [T] int64; return the next-token logits after each of the last
        `num_logits` of them, [num_logits, V] float32 (the LM head runs only there)."""
        out = self.model(input_ids=tokens.view(1, -1), cache=self.cache, use_cache=True,
                         logits_to_keep=num_logits)
        self._length += tokens.numel()
        return out.logits[0].float()

    def truncate(self, length: int) -> None:
        """Drop every cache entry past `length` tokens (rejected drafts)."""
        if length < self._length:
            self.cache.crop(length - self._length)  # transformers 5: a negative count to drop
            self._length = length
