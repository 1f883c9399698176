"""A transformers decoder-only LM over B rows at once, each with its own length (ragged batches).

This is the engine's one causal backend: a single prompt is a batch of one row.

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

When every slot is valid (always so for one row: its rollbacks crop), no mask is passed and the
model takes its ordinary causal path, which is what plain decoding with transformers runs.

Padding queries attend to themselves only: a query with no visible key would make SDPA return
NaN, and a NaN value vector poisons every query that multiplies it, even with weight 0.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from specdecode.models import lean as lean_decoder
from specdecode.models.backend import check_empty_row, check_feeds, check_tree, check_tree_paths, check_truncate
from specdecode.models.kernels import without_onednn
from specdecode.models.quant import QUANTIZED_LINEAR

# Compact once dead slots exceed both this many slots and the longest row's length: compaction
# copies the whole cache, so it should happen rarely, while dead slots must not dominate the
# attention cost.
COMPACT_MIN_DEAD = 64
COMPACT_RATIO = 1.0


def _holds_states(layer) -> bool:
    """Whether a layer of a transformers DynamicCache holds states (a layer no forward has
    written yet holds none, or empty ones after a crop to 0 slots)."""
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def _held_states(cache) -> Iterator[tuple[object, str, torch.Tensor]]:
    """(layer, "keys" or "values", states [B, heads, S, head_dim]) for every layer of a
    transformers DynamicCache that holds states: what a change to the rows or slots of the
    cache (add a row, move or gather slots) must change, each with setattr(layer, name, new) or
    in place."""
    for layer in cache.layers:
        if _holds_states(layer):
            for name in ("keys", "values"):
                yield layer, name, getattr(layer, name)


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


def has_sliding_window(model) -> bool:
    """Sliding-window attention counts its window in slots, so such a model gets one row at a time."""
    config = model.config
    if getattr(config, "sliding_window", None):
        return True
    return any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or ()))


class HFCausalLM:
    """Wraps a transformers decoder-only `PreTrainedModel` for B ragged rows (see module doc).

    Args:
        model: a loaded causal LM; put in eval mode, never otherwise modified.
        vocab_limit: score only token ids below this (for a draft model: the LM head of a small
            model is a large share of its cost). BPE vocabularies put frequent tokens first, so
            a draft that never proposes rare ids loses little acceptance; its q is zero there,
            and the verifier stays exact (docs/exactness.md rule 6). None scores the whole vocabulary.
        compact_min_dead, compact_ratio: compact the cache once its dead slots (S − longest row)
            exceed compact_min_dead and compact_ratio × the longest row; 0, 0 compacts whenever
            any slot is dead (for tests).
        device: where tokens go in; None: where the input embeddings are (a weightless skeleton
            whose forward is a decoder over other weights gives it: models.kquant).
    Attributes:
        vocab_size: V, the width of the logits (the LM head's rows, which may exceed the
            tokenizer's length: rule 6), or vocab_limit.
        num_embeddings: ids below this can be fed; the engine feeds a placeholder for others.
        max_length: the context window in tokens per row (max_position_embeddings), or None.
        max_rows: 1 for sliding-window models, else None (no limit).
        device: where the input embeddings are (the first device of a model spread over several
            with a device_map); every tensor it makes goes there, the logits too.
        one_row_onednn: False runs a call of one row and one token (a plain step, a draft step
            alone) without oneDNN, on torch's own matrix-vector kernels: the same bfloat16
            arithmetic (float32 accumulation), and on some CPUs the faster one (AVX-512-BF16
            Zen 4: a target step 197 against 281 ms, docs/auto-configuration.md). True (default) leaves
            torch's choice; dtype="auto" times both (specdecode.measure.autoconfig).
        batch_invariant: whether every forward runs on the batch-invariant kernels
            (use_invariant_forward; False by default).
        eager_attention: whether the lean forward's narrow calls (a draft step, a short catch-up)
            use eager attention, as a prepared draft asks; set False for SDPA, which some CPUs
            run faster even for one query row (dtype="auto" times both). False without a lean
            forward.
    Raises:
        ValueError: vocab_limit on a model whose LM head is not a plain linear layer.
    """

    def __init__(self, model, vocab_limit: int | None = None, compact_min_dead: int = COMPACT_MIN_DEAD,
                 compact_ratio: float = COMPACT_RATIO, lean: bool = False, device: torch.device | None = None):
        from transformers import DynamicCache

        self.model = model.eval()
        self._cache_class = DynamicCache
        self._head, self.vocab_size = limited_head(model, vocab_limit)
        self.num_embeddings = model.get_input_embeddings().num_embeddings
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.sliding = has_sliding_window(model)
        self.max_rows = 1 if self.sliding else None
        self.device = device or model.get_input_embeddings().weight.device
        self.compact_min_dead, self.compact_ratio = compact_min_dead, compact_ratio
        self.one_row_onednn = True
        self.batch_invariant = False  # use_invariant_forward() sets it
        # a draft's forward without transformers' per-module overhead (models/lean.py), where it
        # reproduces the model; a target keeps transformers' own
        self._lean = lean_decoder.LeanDecoder(model) if lean and not self.sliding and lean_decoder.supports(model) \
            else None
        self.reset()

    def use_invariant_forward(self, share: bool = False) -> None:
        """Run every forward (prompt reads, verifies, steps, prompt scoring) and the LM head on the
        batch-invariant kernels (models/invariant.py): a token's logits are then the same bits
        whatever else a call holds. share: the model's fused weights become views (a model this
        process loaded).

        Raises:
            ValueError: a model the invariant forward does not cover (see invariant.usable).
            specdecode.native.NativeUnavailable: no kernels on this machine.
        """
        from specdecode.models.invariant import InvariantDecoder

        if self.sliding:
            raise ValueError("the batch-invariant forward needs full attention")
        self.use_decoder(InvariantDecoder(self.model, share,
                                          vocab_limit=self.vocab_size if self._head is not None else None))

    def use_decoder(self, decoder) -> None:
        """Run every forward and the LM head on `decoder`, a models.invariant.InvariantDecoder (of
        this model, or of a GGUF file's own blocks for a weightless skeleton: models.kquant)."""
        self._lean = decoder
        self._head = decoder.head
        self.batch_invariant = True

    @property
    def eager_attention(self) -> bool:
        return self._lean is not None and self._lean.eager

    @eager_attention.setter
    def eager_attention(self, eager: bool) -> None:
        if self._lean is not None:
            self._lean.eager = eager

    def reset(self) -> None:
        """Drop every row."""
        self.cache = self._new_cache()
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self._trees = None  # after a tree forward: per row, (first tree slot, parents) or None

    def _new_cache(self):
        cache = self._cache_class(config=self.model.config)
        # Sliding-window layers drop states past the window unless told to keep them, and then a
        # rollback past the window would be impossible.
        for layer in getattr(cache, "layers", []):
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        return cache

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return self._lengths.tolist()

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def add_row(self, encoder_input_ids=None, prefix_ids=()) -> None:
        """Append a row (a request joins the batch) holding prefix_ids, read alone (`fill`).

        Raises:
            ValueError: encoder_input_ids given (this is a decoder-only model), or a second row
                on a sliding-window model.
        """
        if encoder_input_ids is not None:
            raise ValueError("a decoder-only model takes no encoder input")
        if self.max_rows is not None and self.num_rows >= self.max_rows:
            raise ValueError(f"{type(self.model).__name__} uses sliding-window attention: one row at a time")
        if self.num_rows == 0:
            self.reset()
        self.valid = torch.cat([self.valid, torch.zeros((1, self.num_slots), dtype=torch.bool, device=self.device)])
        self._lengths = torch.cat([self._lengths, self._lengths.new_zeros(1)])
        for layer, name, states in _held_states(self.cache):
            setattr(layer, name, torch.cat([states, states.new_zeros((1, *states.shape[1:]))]))
        if prefix_ids:
            self.fill(self.num_rows - 1, prefix_ids)

    @torch.inference_mode()
    def fill(self, row: int, ids) -> None:
        """Give the empty row `row` the tokens ids, read in a forward of its own.

        Their keys and values go right-aligned into the row's slots (every row gets that many
        invalid slots more on the left if ids are longer than the cache). Reading them with the
        next batched forward instead would pad every other row's feed to their length: with B
        rows a 150-token prompt would cost B × 150 token reads, not 150.

        Raises:
            ValueError: the row already holds tokens.
        """
        check_empty_row(row, int(self._lengths[row]))
        n = len(ids)
        if n == 0:
            return
        read = self._read_alone([int(t) for t in ids])
        grow = max(0, n - self.num_slots)
        width = self.num_slots + grow
        self.valid = torch.nn.functional.pad(self.valid, (grow, 0), value=False)
        self.valid[row, width - n:] = True
        self._lengths[row] = n
        for layer, new in zip(self.cache.layers, read):
            empty = not _holds_states(layer)
            for name, states_read in zip(("keys", "values"), new):
                if empty:  # nothing read before: every row gets `width` invalid slots
                    states = states_read.new_zeros((self.num_rows, states_read.shape[1], width, states_read.shape[3]))
                else:
                    states = torch.nn.functional.pad(getattr(layer, name), (0, 0, grow, 0))
                states[row, :, width - n:] = states_read[0]
                setattr(layer, name, states)
            if empty:
                layer.is_initialized, layer.device = True, self.device

    @torch.inference_mode()
    def _read_alone(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) [1, H, len(ids), D] for ids read from position 0."""
        cache = self._new_cache()
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self._lean is not None:
            self._lean(tokens, None, torch.arange(len(ids), device=self.device)[None], cache)
        else:
            self.model.get_decoder()(input_ids=tokens, cache=cache, use_cache=True)
        return [(layer.keys, layer.values) for layer in cache.layers]

    SCORE_CHUNK = 512  # positions whose logits score() holds at once (V floats each)

    @torch.inference_mode()
    def score(self, ids: list[int]) -> Iterator[torch.Tensor]:
        """The next-token logits after each of ids, read alone from position 0 without the rows'
        cache, a plain forward of the model (prompt logprobs): [n, V] float32 chunks, in order,
        covering len(ids) positions. For the Llama/Qwen2 family the decoder runs once and the LM
        head per chunk of SCORE_CHUNK positions, so a long prompt never holds len(ids) × V
        floats; other models give one chunk (their forward may transform the logits)."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self.batch_invariant:  # the same bits as the same tokens read by forward()
            hidden = self._lean(tokens, None, torch.arange(len(ids), device=self.device)[None],
                                self._new_cache())[0]
            for start in range(0, len(ids), self.SCORE_CHUNK):
                yield self._head(hidden[start:start + self.SCORE_CHUNK])
            return
        if not lean_decoder.supports(self.model):
            yield self.model(input_ids=tokens, use_cache=False).logits[0, :, :self.vocab_size].float().to(self.device)
            return
        hidden = self.model.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state[0]
        head = self.model.get_output_embeddings()
        for start in range(0, len(ids), self.SCORE_CHUNK):
            yield head(hidden[start:start + self.SCORE_CHUNK])[:, :self.vocab_size].float()

    @torch.inference_mode()
    def forward(self, feeds: list[list[int]], num_logits: int,
                trees: list[list[int] | None] | None = None) -> torch.Tensor:
        """Append feeds[b] (possibly empty) to row b; return the next-token logits after each of
        the last `num_logits` slots, [B, num_logits, V] float32. Entries of a row that fall on its
        padding (fewer than num_logits new tokens) are meaningless.

        trees: per row, None or the parents of a token tree that forms the last len(parents)
            tokens of its feed (parent -1: the token before the tree; else an earlier node).
            Each node attends to the row's tokens before the tree and to its own ancestors, at
            position (tokens before the tree) + depth, so its logits are those of its own path
            alone (SpecInfer's tree attention). keep_tree_paths must follow before any other call.
        Raises:
            ValueError: len(feeds) differs from the number of rows, or every feed is empty.
        """
        check_feeds(feeds, self.num_rows)
        batch, width = len(feeds), max(len(f) for f in feeds)
        trees = trees if trees is not None and any(t is not None for t in trees) else None
        if trees is not None and self.sliding:
            raise ValueError(f"{type(self.model).__name__} uses sliding-window attention, which counts slots: "
                             "token trees need full attention")
        self._trees = None
        if all(len(f) == width for f in feeds):
            tokens = torch.tensor(feeds, dtype=torch.long, device=self.device)
            new_valid = torch.ones((batch, width), dtype=torch.bool, device=self.device)
        else:
            tokens = torch.zeros((batch, width), dtype=torch.long, device=self.device)
            new_valid = torch.zeros((batch, width), dtype=torch.bool, device=self.device)
            for b, feed in enumerate(feeds):
                if feed:
                    tokens[b, width - len(feed):] = torch.tensor(feed, dtype=torch.long, device=self.device)
                    new_valid[b, width - len(feed):] = True
        positions = (self._lengths[:, None] + new_valid.long().cumsum(1) - 1).clamp(min=0)
        valid = torch.cat([self.valid, new_valid], dim=1)
        tree_blocks = None
        if trees is not None:
            tree_blocks = self._tree_blocks(trees, [len(f) for f in feeds], positions, width)
        # Dense rows (one row always is) need no mask: the model's own causal path.
        mask = None if bool(valid.all()) and trees is None else self._mask(valid, width, tree_blocks)
        with without_onednn() if batch * width == 1 and not self.one_row_onednn else contextlib.nullcontext():
            if self._lean is not None:
                hidden = self._lean(tokens, mask, positions, self.cache)
                logits = (self._head or self.model.get_output_embeddings())(hidden[:, -num_logits:])
            elif self._head is not None:
                hidden = self.model.get_decoder()(input_ids=tokens, attention_mask=mask, position_ids=positions,
                                                  cache=self.cache, use_cache=True).last_hidden_state
                logits = self._head(hidden[:, -num_logits:])
            else:
                logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                                    use_cache=True, logits_to_keep=num_logits).logits
        if trees is not None:
            first = self.num_slots + width  # slot index of each tree's first node, from its end
            self._trees = [None if t is None else (first - len(t), list(t)) for t in trees]
        self.valid = valid
        self._lengths = self._lengths + new_valid.sum(1)
        return logits.float().to(self.device)  # no-op unless a device_map put the head elsewhere

    def _tree_blocks(self, trees, feed_lengths: list[int], positions: torch.Tensor, width: int) -> list:
        """Per tree row: (first column among the new tokens, [n, n] ancestor-or-self map); sets
        the nodes' positions to the position after the tokens before the tree plus their depth."""
        blocks = []
        for b, parents in enumerate(trees):
            if parents is None:
                blocks.append(None)
                continue
            check_tree(b, parents, feed_lengths[b])
            n = len(parents)
            sees = torch.eye(n, dtype=torch.bool)
            depth = [0] * n
            for i, parent in enumerate(parents):
                if parent >= 0:
                    sees[i] |= sees[parent]
                    depth[i] = depth[parent] + 1
            positions[b, width - n:] = self._lengths[b] + feed_lengths[b] - n + torch.tensor(depth, device=self.device)
            blocks.append((width - n, sees.to(self.device)))
        return blocks

    @torch.inference_mode()
    def keep_tree_paths(self, paths: list[list[int] | None]) -> None:
        """After a tree forward: row b keeps, of its tree, only the nodes of paths[b] (a path from
        the root down, possibly empty); None leaves a row without a tree as it is. The cache then
        holds exactly the row's tokens before the tree and that path.

        Raises:
            ValueError: no tree forward came just before, a tree row given None, or a path that
                is not a root-to-node path of its tree.
        """
        check_tree_paths(paths, None if self._trees is None else [None if t is None else t[1] for t in self._trees])
        for b, (tree, path) in enumerate(zip(self._trees, paths)):
            if tree is None:
                continue
            first, parents = tree
            self._move_path(b, [first + i for i in path], first)
            self.valid[b, first:first + len(parents)] = False
            self.valid[b, first:first + len(path)] = True
            self._lengths[b] -= len(parents) - len(path)
        self._trees = None
        self._reclaim()

    def _move_path(self, b: int, slots: list[int], first: int) -> None:
        """Copy row b's cache entries at `slots` to slots first, first+1, ...: the kept path sits
        right after the tokens before the tree, so the slots after it are free (and a row with no
        holes keeps the model's unmasked path). Keys keep their rotary positions (base + depth)."""
        if slots == list(range(first, first + len(slots))):
            return
        source = torch.tensor(slots, dtype=torch.long, device=self.device)
        target = torch.arange(first, first + len(slots), device=self.device)
        for _, _, states in _held_states(self.cache):
            states[b, :, target] = states[b, :, source]

    def _mask(self, valid: torch.Tensor, width: int, tree_blocks: list | None = None) -> torch.Tensor:
        """[B, 1, T, S] additive float mask: 0 where the query may look, dtype-min elsewhere."""
        slots = valid.shape[1]
        key = torch.arange(slots, device=self.device)
        query = torch.arange(slots - width, slots, device=self.device)
        causal = key[None, :] <= query[:, None]                      # [T, S]
        allowed = valid[:, None, :] & causal[None]                   # [B, T, S]
        for b, block in enumerate(tree_blocks or []):
            if block is not None:  # a tree's nodes see their ancestors, not their other elders
                start, sees = block
                n = sees.shape[0]
                allowed[b, start:, slots - n:] = sees
        allowed |= (key[None, :] == query[:, None])[None]            # padding queries see themselves
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    @torch.inference_mode()
    def truncate(self, lengths: list[int]) -> None:
        """Keep only the first lengths[b] tokens of row b (rejected drafts leave).

        Raises:
            ValueError: a length beyond what the row holds.
        """
        new = torch.tensor(check_truncate(lengths, self.lengths), dtype=torch.long, device=self.device)
        self.valid = self.valid & (self.valid.long().cumsum(1) <= new[:, None])
        self._lengths = new
        self._reclaim()

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished requests leave the batch)."""
        if not rows:
            self.reset()
            return
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if self.num_slots:
            self.cache.batch_select_indices(index)
        self.valid, self._lengths = self.valid[index], self._lengths[index]
        self._reclaim()

    def _reclaim(self) -> None:
        live = self.valid.any(0).nonzero()
        end = int(live.max()) + 1 if len(live) else 0
        if end == 0 and self.num_slots and not self.sliding:
            # Nothing is held: start from an empty cache. Cropped to 0 slots, its states would
            # keep this batch's size, and `select` (which has no slots to select) could not fix it.
            self.cache = self._new_cache()
            self.valid = self.valid[:, :0]
        elif end < self.num_slots or (self.sliding and self.num_slots):
            # transformers 5 takes a negative count to drop; crop(0) still trims the recorded
            # states of sliding-window layers back to their window.
            self.cache.crop(end - self.num_slots)
            self.valid = self.valid[:, :end]
        longest = int(self._lengths.max()) if len(self._lengths) else 0
        dead = self.num_slots - longest
        if dead > self.compact_min_dead and dead > self.compact_ratio * longest:
            self._compact()

    def _compact(self) -> None:
        """Gather each row's valid slots, right-aligned, to max(lengths) slots. Keys keep their
        rotary positions, so nothing is recomputed."""
        width = int(self._lengths.max())
        # A stable sort of the 0/1 map puts invalid slots first and valid ones after, in order.
        order = torch.sort(self.valid.to(torch.uint8), dim=1, stable=True).indices[:, self.num_slots - width:]
        for layer, name, states in _held_states(self.cache):
            index = order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
            setattr(layer, name, states.gather(2, index))
        self.valid = self.valid.gather(1, order)
