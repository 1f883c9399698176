"""A transformers encoder–decoder model (T5, flan-t5, BART, ...) seen from its decoder side.

The paper's walltime experiments (§4.1) speculate with T5: the target and the draft each encode
the input once, then only their decoders take part in Algorithm 1. So this backend encodes once
per request (`set_input`) and otherwise behaves exactly like HFCausalLM on the decoder tokens:
the decoding loop and the proposers run unchanged, with the decoder prompt
[decoder_start_token_id] as the "prompt".
"""

from __future__ import annotations

import torch


def decoder_start_token_id(model) -> int:
    """The id the decoder starts from (generation_config first, as transformers' generate).

    Raises:
        ValueError: neither the generation config nor the model config names one.
    """
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "decoder_start_token_id", None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(model).__name__} has no decoder_start_token_id in its config or "
                     "generation config; set model.config.decoder_start_token_id")


class Seq2SeqLM:
    """Wraps an encoder–decoder `PreTrainedModel`: one encoded input, one decoder KV cache.

    The cache is an EncoderDecoderCache. Its self-attention half grows with the decoder tokens
    and is the only part rolled back; its cross-attention half (keys and values of the encoder
    output) is computed by the first decoder call after `set_input` and then reused, never
    cropped, including across `reset()` for the same input.

    Args:
        model: a loaded encoder–decoder model (config.is_encoder_decoder); put in eval mode,
            never otherwise modified.
    Attributes:
        vocab_size: V, the width of the decoder's logits (its LM head's rows).
        max_length: the decoder's context window (max_position_embeddings; BART), or None for
            relative-position models (T5).
        decoder_start_token_id: the decoder prompt's only token.
    Raises:
        ValueError: the model is not an encoder–decoder, or has no decoder_start_token_id.
    """

    def __init__(self, model):
        if not getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is not an encoder-decoder model; use HFCausalLM")
        self.model = model.eval()
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.decoder_start_token_id = decoder_start_token_id(model)
        self.input_ids: list[int] | None = None
        self._encoder_outputs = None
        self._cross_cache = None
        self.reset()

    @property
    def length(self) -> int:
        """Decoder tokens held in the self-attention cache."""
        return self._length

    @torch.inference_mode()
    def set_input(self, input_ids) -> None:
        """Encode the request's input ([T] token ids, no padding) once; the same input again
        keeps the encoder output and its cross-attention keys/values. Empties the decoder cache."""
        ids = [int(t) for t in input_ids]
        if ids != self.input_ids:
            self._encoder_outputs = self.model.get_encoder()(input_ids=torch.tensor([ids], dtype=torch.long))
            self._cross_cache = None
            self.input_ids = ids
        self.reset()

    def reset(self) -> None:
        """Empty the decoder's self-attention cache; keep the encoder side of the current input."""
        from transformers import DynamicCache, EncoderDecoderCache

        # Layers are created as the decoder writes them (no config: T5's decoder may have another
        # depth than its encoder). An already-filled cross cache marks itself as reusable.
        cross = self._cross_cache if self._cross_cache is not None else DynamicCache()
        self.cache = EncoderDecoderCache(DynamicCache(), cross)
        self._length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Append decoder tokens [T] int64; return the next-token logits after each of the last
        `num_logits` of them, [num_logits, V] float32.

        Raises:
            RuntimeError: no input was set (call set_input first).
        """
        if self._encoder_outputs is None:
            raise RuntimeError("Seq2SeqLM.forward before set_input(input_ids): the encoder has no input")
        out = self.model(encoder_outputs=self._encoder_outputs, decoder_input_ids=tokens.view(1, -1),
                         cache=self.cache, use_cache=True)
        self._cross_cache = self.cache.cross_attention_cache
        self._length += tokens.numel()
        return out.logits[0, -num_logits:].float()

    def truncate(self, length: int) -> None:
        """Drop decoder self-attention entries past `length` tokens (rejected drafts); the
        cross-attention cache depends only on the input and is left whole."""
        if length < self._length:
            # EncoderDecoderCache.crop crops only the self-attention cache; it takes a negative
            # count of tokens to drop (transformers 5).
            self.cache.crop(length - self._length)
            self._length = length
