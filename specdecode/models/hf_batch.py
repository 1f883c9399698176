"""A transformers causal LM over B sequences at once, each with its own length (ragged batches).

Layout. The KV cache has S *slots* per row, shared by all rows: every forward appends the same
number T of slots to every row. Row b's new tokens are right-aligned in its T slots; the slots
before them are padding. A boolean map `valid` [B, S] says which slots hold a committed or
in-flight token of that row; rolling a row back (rejected drafts) clears its last valid slots
instead of cropping, since the other rows keep theirs. Invalid slots are never attended: each
forward gets an explicit 4D mask (query sees key j iff j is a valid slot of its row at or
before it). Each row's position ids count only its valid tokens, so RoPE sees exactly the
positions the row would have alone. Slots invalid in every row at the end are cropped, and when
dead slots outnumber the live ones the cache is compacted (each row's valid slots gathered,
right-aligned), so attention cost tracks the committed length, not the rejected drafts.

Padding queries attend to themselves only: a query with no visible key would make SDPA return
NaN, and a NaN value vector poisons every query that multiplies it, even with weight 0.
"""

from __future__ import annotations

import torch

from specdecode.models.hf import limited_head

# Compact once dead slots exceed both this many slots and the longest row's length: compaction
# copies the whole cache, so it should happen rarely, while dead slots must not dominate the
# attention cost.
COMPACT_MIN_DEAD = 64
COMPACT_RATIO = 1.0


def supports_batching(model) -> bool:
    """False for sliding-window attention: its window is counted in slots here, not in tokens."""
    config = model.config
    if getattr(config, "sliding_window", None):
        return False
    return not any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or ()))


class HFBatchedCausalLM:
    """Wraps a transformers decoder-only `PreTrainedModel` for B ragged sequences (see module doc).

    Args:
        model: a loaded causal LM without sliding-window attention; never modified.
        vocab_limit: score only ids below this (see HFCausalLM); None scores the whole vocabulary.
        compact_min_dead, compact_ratio: compact the cache once its dead slots (S − longest row)
            exceed compact_min_dead and compact_ratio × the longest row; 0, 0 compacts whenever
            any slot is dead (for tests).
    Attributes:
        vocab_size: V.  max_length: the context window in tokens per row, or None.
        lengths: [B] int64, tokens held per row (the next token's position id).
    Raises:
        ValueError: a sliding-window model, or vocab_limit on a non-linear LM head.
    """

    def __init__(self, model, vocab_limit: int | None = None, compact_min_dead: int = COMPACT_MIN_DEAD,
                 compact_ratio: float = COMPACT_RATIO):
        from transformers import DynamicCache

        if not supports_batching(model):
            raise ValueError(f"{type(model).__name__} uses sliding-window attention, which the batched "
                             "backend does not support; decode its prompts one at a time (batch_size=1)")
        self.model = model.eval()
        self._cache_class = DynamicCache
        self._head, self.vocab_size = limited_head(model, vocab_limit)
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.compact_min_dead, self.compact_ratio = compact_min_dead, compact_ratio
        self.start(1)

    def start(self, batch_size: int) -> None:
        """Empty the cache and hold `batch_size` empty rows."""
        self.cache = self._cache_class(config=self.model.config)
        self.valid = torch.zeros((batch_size, 0), dtype=torch.bool)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @torch.inference_mode()
    def forward(self, feeds: list[list[int]], num_logits: int) -> torch.Tensor:
        """Append feeds[b] (possibly empty) to row b; return the next-token logits after each of
        the last `num_logits` slots, [B, num_logits, V] float32. Entries of a row that fall on its
        padding (fewer than num_logits new tokens) are meaningless.

        Raises:
            ValueError: len(feeds) differs from the batch size, or every feed is empty.
        """
        batch, width = len(feeds), max((len(f) for f in feeds), default=0)
        if batch != self.valid.shape[0] or width == 0:
            raise ValueError(f"need {self.valid.shape[0]} feeds, not all empty; got lengths {[len(f) for f in feeds]}")
        tokens = torch.zeros((batch, width), dtype=torch.long)
        new_valid = torch.zeros((batch, width), dtype=torch.bool)
        for b, feed in enumerate(feeds):
            if feed:
                tokens[b, width - len(feed):] = torch.as_tensor(feed, dtype=torch.long)
                new_valid[b, width - len(feed):] = True
        positions = (self.lengths[:, None] + new_valid.long().cumsum(1) - 1).clamp(min=0)
        valid = torch.cat([self.valid, new_valid], dim=1)
        mask = self._mask(valid, width)
        if self._head is not None:
            hidden = self.model.get_decoder()(input_ids=tokens, attention_mask=mask, position_ids=positions,
                                              cache=self.cache, use_cache=True).last_hidden_state
            logits = self._head(hidden[:, -num_logits:])
        else:
            logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                                use_cache=True, logits_to_keep=num_logits).logits
        self.valid = valid
        self.lengths = self.lengths + new_valid.sum(1)
        return logits.float()

    def _mask(self, valid: torch.Tensor, width: int) -> torch.Tensor:
        """[B, 1, T, S] additive float mask: 0 where the query may look, dtype-min elsewhere."""
        slots = valid.shape[1]
        key = torch.arange(slots)
        query = torch.arange(slots - width, slots)
        causal = key[None, :] <= query[:, None]                      # [T, S]
        allowed = valid[:, None, :] & causal[None]                   # [B, T, S]
        allowed |= (key[None, :] == query[:, None])[None]            # padding queries see themselves
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    @torch.inference_mode()
    def truncate(self, lengths: list[int]) -> None:
        """Keep only the first lengths[b] tokens of row b (rejected drafts leave).

        Raises:
            ValueError: a length beyond what the row holds.
        """
        new = torch.as_tensor(lengths, dtype=torch.long)
        if new.shape != self.lengths.shape or bool((new > self.lengths).any()) or bool((new < 0).any()):
            raise ValueError(f"cannot truncate rows holding {self.lengths.tolist()} tokens to {lengths}")
        self.valid = self.valid & (self.valid.long().cumsum(1) <= new[:, None])
        self.lengths = new
        self._reclaim()

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished requests leave the batch)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.valid, self.lengths = self.valid[index], self.lengths[index]
        self._reclaim()

    def _reclaim(self) -> None:
        live = self.valid.any(0).nonzero()
        end = int(live.max()) + 1 if len(live) else 0
        if end < self.num_slots:
            self.cache.crop(end - self.num_slots)
            self.valid = self.valid[:, :end]
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        dead = self.num_slots - longest
        if dead > self.compact_min_dead and dead > self.compact_ratio * longest:
            self._compact()

    def _compact(self) -> None:
        """Gather each row's valid slots, right-aligned, to max(lengths) slots. Keys keep their
        rotary positions, so nothing is recomputed."""
        width = int(self.lengths.max())
        # A stable sort of the 0/1 map puts invalid slots first and valid ones after, in order.
        order = torch.sort(self.valid.to(torch.uint8), dim=1, stable=True).indices[:, self.num_slots - width:]
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)
                index = order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
                setattr(layer, name, states.gather(2, index))
        self.valid = self.valid.gather(1, order)
