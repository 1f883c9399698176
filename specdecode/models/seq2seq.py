"""A transformers encoder–decoder model (T5, flan-t5, BART, ...) seen from its decoder side.

The paper's walltime experiments (§4.1) speculate with T5: the target and the draft each encode
the input once, then only their decoders take part in Algorithm 1. So this backend encodes once
per request (`add_row(encoder_input_ids)`) and otherwise behaves like HFCausalLM on the decoder
tokens: the engine and the proposers run unchanged, with the decoder prompt
[decoder_start_token_id] as the "prompt". It holds one row at a time (`max_rows` = 1): the engine
queues the other requests.
"""

from __future__ import annotations

import torch

from specdecode.models.backend import check_feeds, check_truncate


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
    """Wraps an encoder–decoder `PreTrainedModel`: one encoded input, one decoder KV cache, one row.

    The cache is an EncoderDecoderCache. Its self-attention half grows with the decoder tokens
    and is the only part rolled back; its cross-attention half (keys and values of the encoder
    output) is computed by the first decoder call after the input is set and then reused, never
    cropped, including when the next request has the same input.

    Args:
        model: a loaded encoder–decoder model (config.is_encoder_decoder); put in eval mode,
            never otherwise modified.
    Attributes:
        vocab_size: V, the width of the decoder's logits (its LM head's rows).
        num_embeddings: decoder ids below this can be fed.
        max_length: the decoder's context window (max_position_embeddings; BART), or None for
            relative-position models (T5).
        max_rows: 1.  device: where the model's parameters are.
        decoder_start_token_id: the decoder prompt's only token.
    Raises:
        ValueError: the model is not an encoder–decoder, or has no decoder_start_token_id.
    """

    max_rows = 1

    def __init__(self, model):
        if not getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is not an encoder-decoder model; use HFCausalLM")
        self.model = model.eval()
        self.vocab_size = model.get_output_embeddings().out_features
        self.num_embeddings = model.get_input_embeddings().num_embeddings
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.decoder_start_token_id = decoder_start_token_id(model)
        self.input_ids: list[int] | None = None
        self._encoder_outputs = None
        self._cross_cache = None
        self.reset()

    @property
    def num_rows(self) -> int:
        return int(self._has_row)

    @property
    def lengths(self) -> list[int]:
        """Decoder tokens held in the self-attention cache, per row."""
        return [self._length] if self._has_row else []

    def reset(self) -> None:
        """Drop the row; keep the encoder side of the current input for a request with the same one."""
        self._has_row = False
        self._new_cache()

    def _new_cache(self) -> None:
        from transformers import DynamicCache, EncoderDecoderCache

        # Layers are created as the decoder writes them (no config: T5's decoder may have another
        # depth than its encoder). An already-filled cross cache marks itself as reusable.
        cross = self._cross_cache if self._cross_cache is not None else DynamicCache()
        self.cache = EncoderDecoderCache(DynamicCache(), cross)
        self._length = 0

    @torch.inference_mode()
    def add_row(self, encoder_input_ids=None, prefix_ids=()) -> None:
        """Take the request's input ([T] token ids, no padding): encode it once (the same input
        as the last request keeps its encoder output and cross-attention keys/values) and start an
        empty decoder row.

        Raises:
            ValueError: no encoder input, a decoder prefix (a single row reads its prefix with
                its first forward), or a row is already held.
        """
        if prefix_ids:
            raise ValueError("an encoder-decoder backend reads its decoder prefix with the first forward")
        if encoder_input_ids is None:
            raise ValueError("an encoder-decoder model needs the request's encoder input")
        if self._has_row:
            raise ValueError("an encoder-decoder backend holds one row at a time")
        ids = [int(t) for t in encoder_input_ids]
        if ids != self.input_ids:
            self._encoder_outputs = self.model.get_encoder()(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self.device))
            self._cross_cache = None
            self.input_ids = ids
        self._new_cache()
        self._has_row = True

    def select(self, rows: list[int]) -> None:
        """Keep row 0 ([0]) or drop it ([])."""
        if not rows:
            self.reset()

    @torch.inference_mode()
    def forward(self, feeds: list[list[int]], num_logits: int) -> torch.Tensor:
        """Append decoder tokens feeds[0]; return the next-token logits after each of the last
        `num_logits` of them, [1, num_logits, V] float32.

        Raises:
            ValueError: not exactly one non-empty feed (add_row first).
        """
        check_feeds(feeds, self.num_rows)  # one row at most: its feed must hold tokens
        tokens = torch.tensor([feeds[0]], dtype=torch.long, device=self.device)
        out = self.model(encoder_outputs=self._encoder_outputs, decoder_input_ids=tokens,
                         cache=self.cache, use_cache=True)
        self._cross_cache = self.cache.cross_attention_cache
        self._length += tokens.shape[1]
        return out.logits[:, -num_logits:].float()

    def truncate(self, lengths: list[int]) -> None:
        """Drop decoder self-attention entries past lengths[0] tokens (rejected drafts); the
        cross-attention cache depends only on the input and is left whole.

        Raises:
            ValueError: a length beyond what the row holds.
        """
        lengths = check_truncate(lengths, self.lengths)
        if lengths and lengths[0] < self._length:
            # EncoderDecoderCache.crop crops only the self-attention cache; it takes a negative
            # count of tokens to drop (transformers 5).
            self.cache.crop(lengths[0] - self._length)
            self._length = lengths[0]
