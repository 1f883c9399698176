"""llama.cpp as a backend: a GGUF model's forwards through llama-cpp-python's low-level C API, for
B rows at once, under the engine's exact speculative loop (docs/ARCHITECTURE.md, docs/llamacpp.md).

Layout. One llama.cpp context holds every row: row b is a llama.cpp *sequence* (a seq id) in one
KV cache shared by all sequences (`kv_unified`), so a context of n_ctx cells holds any mix of row
lengths that adds up to n_ctx, and one row alone may use all of it. A forward puts every row's
new tokens in ONE `llama_decode` batch, each token tagged with its row's sequence and position,
and asks logits only at the positions the engine reads; llama.cpp's causal mask keeps each
sequence to its own cells, so no padding is fed. Rollback is `llama_memory_seq_rm` of a row's
positions past its new length; `select` remaps rows to sequences and frees the dropped ones.
The logits are copied once out of llama.cpp's output buffer (which the next decode overwrites)
into the [B, num_logits, V] float32 tensor the engine reads.

What llama.cpp's API lacks: a custom attention mask, so token trees (tree_width > 1) are refused;
and bit-equality between a k-token and a one-token call: its matrix kernels differ between 1,
2+ and 4+ rows (as torch's bfloat16 ones do), so a token's logits depend on how many tokens the
call scored (tests/test_llamacpp.py states the tolerance per weight type).

Every foreign call of the backend lives in this module, against llama-cpp-python 0.3.36 (checked
when the library is first used: `library()`, which gguf_convert.py's weight conversions go through
too). Whether llama.cpp's repacked weight layouts run on this machine is repack_probe.py's
question, asked in a child process.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specdecode.models.backend import check_empty_row, check_feeds, check_truncate
from specdecode.models.gguf_files import check_gguf_header, gguf_tokenizer
from specdecode.models.repack_probe import repack_works

PINNED = "llama-cpp-python==0.3.36"
# every function of the C API this module and gguf_convert.py call: a missing one is an ImportError at
# first use
REQUIRED = (
    "llama_backend_init", "llama_log_set", "llama_print_system_info",
    "llama_model_default_params", "llama_model_load_from_file", "llama_model_free", "llama_model_get_vocab",
    "llama_model_n_ctx_train", "llama_model_meta_val_str", "llama_model_desc", "llama_model_quantize_default_params",
    "llama_model_quantize", "llama_vocab_n_tokens", "llama_vocab_is_eog", "llama_tokenize",
    "llama_context_default_params", "llama_init_from_model", "llama_free", "llama_n_ctx", "llama_decode",
    "llama_get_logits", "llama_get_memory", "llama_memory_clear", "llama_memory_seq_rm", "llama_memory_seq_cp",
    "llama_state_seq_get_size", "llama_state_seq_get_data", "llama_state_seq_set_data",
)
LOG_ERROR, LOG_CONT = 4, 5  # ggml_log_level: errors, and the continuation of the previous message
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type of the KV cache
FLASH_ATTN = {None: -1, False: 0, True: 1}   # llama_flash_attn_type: auto, off, on

_lib = None
_log_callback = None  # the ctypes callback must outlive every llama.cpp call that may log


def library():
    """llama-cpp-python's ctypes module (`llama_cpp.llama_cpp`), checked and initialised once:
    every function this module calls exists, llama.cpp's logging goes to stderr for errors only.

    Raises:
        ImportError: llama-cpp-python is not installed, or lacks a function (the message names
            the pinned version to install).
    """
    global _lib, _log_callback
    if _lib is not None:
        return _lib
    try:
        from llama_cpp import llama_cpp as lib
    except ImportError as err:
        raise ImportError(f"GGUF models run on llama.cpp through llama-cpp-python: pip install {PINNED} "
                          f"({type(err).__name__}: {err})") from None
    missing = [name for name in REQUIRED if not hasattr(lib, name)]
    if missing:
        raise ImportError(f"the installed llama-cpp-python lacks {', '.join(missing)}; pip install {PINNED}")
    last = [0]

    def log(level, text, _user_data):
        # llama.cpp reports every load and every context at INFO; keep errors (and their
        # continuation lines) only
        if level == LOG_ERROR or (level == LOG_CONT and last[0] == LOG_ERROR):
            sys.stderr.write(text.decode("utf-8", "replace"))
        if level != LOG_CONT:
            last[0] = level

    _log_callback = lib.llama_log_callback(log)
    lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
    lib.llama_backend_init()
    _lib = lib
    return lib


def available() -> bool:
    """Whether llama-cpp-python is installed (without loading llama.cpp)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def system_info() -> str:
    """llama.cpp's build and CPU features, as its own tools print them (llama_print_system_info)."""
    return library().llama_print_system_info().decode("utf-8", "replace").strip()


class _Batch:
    """A llama_batch over numpy arrays this object owns (filled with vectorized writes, not a
    ctypes call per token); each token belongs to one sequence."""

    def __init__(self, lib, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # seq_id[i] points at seq[i]: llama.cpp reads seq_id[i][0 .. n_seq_id[i])
        base, size = self.seq.ctypes.data, self.seq.itemsize
        int_p = ctypes.POINTER(ctypes.c_int32)
        self.seq_ptrs = (int_p * capacity)(*(ctypes.cast(base + i * size, int_p) for i in range(capacity)))
        self.struct = lib.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(int_p))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


class LlamaCppLM:
    """A GGUF causal LM on llama.cpp for B ragged rows (see module doc): the engine's backend
    protocol (specdecode.models), as HFCausalLM has it, without token trees.

    Args:
        path: a GGUF file llama.cpp can load (any weight type: F32, BF16, Q8_0, Q4_K_M, ...).
        n_ctx: KV cells of the context, shared by all rows (row lengths add up to at most this).
        max_rows: the most rows held at once (llama.cpp sequences; one more is kept for `score`).
        n_threads: threads for one-token and batched calls; None: torch's thread count (the
            physical cores by default), so torch and llama.cpp compute on the same cores.
        n_batch: the most tokens one llama_decode takes (longer reads are split into calls of
            this size); n_ubatch: the most tokens llama.cpp computes in one graph.
        kv_type: the KV cache's element type, "f16" (llama.cpp's default), "bf16" or "f32".
        flash_attn: llama.cpp's flash attention: None lets it choose, True or False forces it.
        grow: when the rows need more cells than n_ctx, rebuild the context with twice the cells
            (or more) and move every row's KV state over (no token is read again); False raises.
        repack: let llama.cpp move weights into its repacked layouts for this CPU (its "extra
            buffer types": AVX/AMX kernels for Q4_0, Q4_K, Q8_0, ...); False keeps every tensor
            in the file's layout and llama.cpp's plain kernels (needed where a build's AMX kernels
            fault, as in a wheel built by GCC 12 on an AMX CPU); None (default): repack where
            `repack_works` says it is safe for this file on this machine and build.
    Attributes:
        vocab_size, num_embeddings: V, the model's vocabulary (the width of its logits).
        max_length: the model's trained context (GGUF context_length) in tokens per row, None
            if the file does not say; with grow=False also at most n_ctx.
        max_rows, device (the CPU: logits come back as CPU tensors), n_ctx (cells now).
        eos_token_ids: the ids llama.cpp ends generation on (its end-of-generation set).
    Raises:
        ImportError: llama-cpp-python missing.  FileNotFoundError: no such file.
        ValueError: an argument out of range, not a GGUF file, or one llama.cpp cannot load.
        RuntimeError: llama.cpp cannot allocate the context.
    """

    SCORE_CHUNK = 128  # positions score() asks logits for per call (llama.cpp keeps a buffer that large)

    def __init__(self, path, *, n_ctx: int = 4096, max_rows: int = 8, n_threads: int | None = None,
                 n_batch: int = 2048, n_ubatch: int = 512, kv_type: str = "f16", flash_attn: bool | None = None,
                 grow: bool = True, repack: bool | None = None):
        lib = library()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
        check_gguf_header(path)
        if n_ctx < 1 or max_rows < 1 or n_batch < 1 or n_ubatch < 1 or (n_threads is not None and n_threads < 1):
            raise ValueError(f"n_ctx, max_rows, n_batch, n_ubatch and n_threads must be >= 1, got "
                             f"{n_ctx}, {max_rows}, {n_batch}, {n_ubatch}, {n_threads}")
        if kv_type not in KV_TYPES or flash_attn not in FLASH_ATTN:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)} and flash_attn None/True/False, "
                             f"got {kv_type!r}, {flash_attn!r}")
        self._lib, self.path = lib, path
        self.n_threads = n_threads or torch.get_num_threads()
        self.n_batch, self.n_ubatch = n_batch, min(n_ubatch, n_batch)
        self.kv_type, self.flash_attn, self.grow = kv_type, flash_attn, grow
        self._limit = None  # a lower context limit set through max_length
        self.max_rows = max_rows
        self._scratch = max_rows  # the sequence score() reads into
        self.device = torch.device("cpu")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.repacked = repack_works(path) if repack is None else repack
        params.use_extra_bufts = self.repacked
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:  # its log above says why
            raise ValueError(f"llama.cpp could not load {str(path)!r}: a damaged or truncated GGUF file, a model "
                             "architecture this llama.cpp build does not know, or too little memory")
        self._ctx = None
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = self.num_embeddings = lib.llama_vocab_n_tokens(self._vocab)
        self._n_ctx_train = lib.llama_model_n_ctx_train(self._model) or None  # 0: the file does not say
        self._use(self._new_context(n_ctx))
        self._batch = _Batch(lib, n_batch)
        self._eog = None
        self.reset()

    # --- the context -----------------------------------------------------------------------------

    def _new_context(self, n_ctx: int):
        """A llama.cpp context of n_ctx cells (llama.cpp may round it up) for this model."""
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, self.n_batch, self.n_ubatch
        params.n_seq_max = self.max_rows + 1
        params.n_threads = params.n_threads_batch = self.n_threads
        params.type_k = params.type_v = KV_TYPES[self.kv_type]
        params.flash_attn_type = FLASH_ATTN[self.flash_attn]
        params.kv_unified = True  # one pool of cells for every row (see module doc)
        params.no_perf = True
        ctx = lib.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} cells for {self.path.name} "
                               "(out of memory?)")
        return ctx

    def _use(self, ctx) -> None:
        self._ctx, self.n_ctx, self._memory = ctx, self._lib.llama_n_ctx(ctx), self._lib.llama_get_memory(ctx)

    @property
    def max_length(self) -> int | None:
        own = self._n_ctx_train if self.grow else \
            self.n_ctx if self._n_ctx_train is None else min(self._n_ctx_train, self.n_ctx)
        return own if self._limit is None else self._limit if own is None else min(own, self._limit)

    @max_length.setter
    def max_length(self, limit: int | None) -> None:
        """A lower limit than the model's (DecoderConfig.max_model_len); None lifts it."""
        self._limit = limit

    def _room_for(self, new_tokens: int) -> None:
        """Make the context hold the rows' tokens plus new_tokens more (grow it, or refuse)."""
        needed = sum(self._lengths) + new_tokens
        if needed <= self.n_ctx:
            return
        if not self.grow:
            raise RuntimeError(f"llama.cpp's context is full: the rows hold {sum(self._lengths)} tokens and need "
                               f"{new_tokens} more, beyond its n_ctx={self.n_ctx} cells; pass a larger n_ctx "
                               "(or grow=True)")
        cells = self.n_ctx
        while cells < needed:
            cells *= 2
        self._regrow(cells)

    def _regrow(self, cells: int) -> None:
        """A context of `cells` cells holding every row's KV state as it is (copied, not re-read)."""
        lib, old = self._lib, self._ctx
        states = []
        for seq in self._seqs:
            size = lib.llama_state_seq_get_size(old, seq)
            buffer = (ctypes.c_uint8 * size)()
            if lib.llama_state_seq_get_data(old, buffer, size, seq) != size:
                raise RuntimeError(f"llama.cpp could not save the state of sequence {seq} to grow its context")
            states.append((seq, buffer, size))
        new = self._new_context(cells)
        for seq, buffer, size in states:
            if lib.llama_state_seq_set_data(new, buffer, size, seq) == 0:
                lib.llama_free(new)  # the old context stays in use, unchanged
                raise RuntimeError(f"llama.cpp could not restore sequence {seq} into a context of {cells} cells")
        self._use(new)
        lib.llama_free(old)

    def close(self) -> None:
        """Free the context and the model (also done when the object is collected)."""
        lib = self._lib
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        # at exit the ctypes functions (and this module's globals: `sys` may be None by then) may
        # be gone, and the OS frees it all; after a refused __init__ there is nothing to free
        if sys is not None and not sys.is_finalizing() and hasattr(self, "_lib"):
            self.close()

    # --- rows --------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every row."""
        self._lib.llama_memory_clear(self._memory, True)
        self._seqs: list[int] = []
        self._lengths: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._seqs)

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return list(self._lengths)

    def _free_seq(self) -> int:
        used = set(self._seqs)
        return next(s for s in range(self.max_rows) if s not in used)

    def add_row(self, encoder_input_ids=None, prefix_ids=()) -> None:
        """Append a row holding prefix_ids, read alone (`fill`).

        Raises:
            ValueError: encoder_input_ids given (a decoder-only model), or max_rows rows held.
        """
        if encoder_input_ids is not None:
            raise ValueError("a decoder-only model takes no encoder input")
        if self.num_rows >= self.max_rows:
            raise ValueError(f"this llama.cpp backend holds at most max_rows={self.max_rows} rows")
        self._seqs.append(self._free_seq())
        self._lengths.append(0)
        if prefix_ids:
            self.fill(self.num_rows - 1, prefix_ids)

    def fill(self, row: int, ids) -> None:
        """Give the empty row `row` the tokens ids, read in calls of its own (no logits).

        Raises:
            ValueError: the row already holds tokens.
        """
        check_empty_row(row, self._lengths[row])
        ids = [int(t) for t in ids]
        if not ids:
            return
        self._room_for(len(ids))
        self._decode_rows([(self._seqs[row], 0, ids, 0)], None, 0)
        self._lengths[row] = len(ids)

    def truncate(self, lengths: list[int]) -> None:
        """Keep only the first lengths[b] tokens of row b (rejected drafts leave).

        Raises:
            ValueError: a length beyond what the row holds, or one length per row not given.
            RuntimeError: llama.cpp refused to remove the positions (llama_memory_seq_rm).
        """
        lengths = check_truncate(lengths, self._lengths)
        for b, (n, held) in enumerate(zip(lengths, self._lengths)):
            if n < held:
                self._remove(self._seqs[b], n)
                self._lengths[b] = n

    def _remove(self, seq: int, start: int) -> None:
        """Positions start.. of a sequence leave the cache (start 0: all of it)."""
        if not self._lib.llama_memory_seq_rm(self._memory, seq, start, -1):
            raise RuntimeError(f"llama.cpp could not remove positions {start}.. of sequence {seq} "
                               "(llama_memory_seq_rm failed; a recurrent model cannot roll back)")

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished requests leave; their sequences are
        freed). A row listed twice is copied (llama_memory_seq_cp)."""
        rows = [int(r) for r in rows]
        if any(not 0 <= r < self.num_rows for r in rows) or len(rows) > self.max_rows:
            raise ValueError(f"cannot select rows {rows} of {self.num_rows} (at most {self.max_rows})")
        kept = {self._seqs[r] for r in rows}
        for seq in set(self._seqs) - kept:
            self._remove(seq, 0)
        seqs, lengths, used = [], [], set()
        for r in rows:
            seq = self._seqs[r]
            if seq in used:  # a second copy of a row: a sequence of its own with the same cells
                seq = next(s for s in range(self.max_rows) if s not in kept and s not in used)
                self._lib.llama_memory_seq_cp(self._memory, self._seqs[r], seq, -1, -1)
            used.add(seq)
            seqs.append(seq)
            lengths.append(self._lengths[r])
        self._seqs, self._lengths = seqs, lengths

    # --- forwards ----------------------------------------------------------------------------------

    def forward(self, feeds: list[list[int]], num_logits: int, trees=None) -> torch.Tensor:
        """Append feeds[b] (possibly empty) to row b in one llama_decode (more only past n_batch
        tokens); return the next-token logits after each of the last `num_logits` tokens of each
        row, [B, num_logits, V] float32 on the CPU: row b's are its last min(num_logits,
        len(feeds[b])) entries, right-aligned; the entries before them are 0.

        trees: must be None (or all None): llama.cpp's API has no custom attention mask.
        Raises:
            ValueError: token trees, len(feeds) differs from the number of rows, or every feed is
                empty.  RuntimeError: llama_decode failed, or the context is full (grow=False).
        """
        if trees is not None and any(t is not None for t in trees):
            raise ValueError("token trees need a custom attention mask, which llama.cpp's API lacks: "
                             "use tree_width=1 with a GGUF model")
        check_feeds(feeds, self.num_rows, num_logits)
        out = torch.empty((len(feeds), num_logits, self.vocab_size), dtype=torch.float32)
        for b, feed in enumerate(feeds):
            if len(feed) < num_logits:  # entries before a short row's logits: 0, never stale memory
                out[b, :num_logits - len(feed)] = 0
        self._room_for(sum(len(f) for f in feeds))
        spans = [(self._seqs[b], self._lengths[b], [int(t) for t in feed], min(num_logits, len(feed)))
                 for b, feed in enumerate(feeds) if feed]
        # where each asked position's logits go in `out`, flattened to [B * num_logits, V]
        dest = [b * num_logits + num_logits - min(num_logits, len(feed)) + j
                for b, feed in enumerate(feeds) for j in range(min(num_logits, len(feed)))]
        self._decode_rows(spans, out.view(-1, self.vocab_size), dest)
        for b, feed in enumerate(feeds):
            self._lengths[b] += len(feed)
        return out

    def score(self, ids: list[int]) -> Iterator[torch.Tensor]:
        """The next-token logits after each of ids, read alone from position 0 in a sequence of
        its own (the rows are untouched): [n, V] float32 chunks of at most SCORE_CHUNK positions,
        in order, covering len(ids) positions (prompt logprobs)."""
        ids = [int(t) for t in ids]
        self._room_for(len(ids))
        try:
            for start in range(0, len(ids), self.SCORE_CHUNK):
                chunk = ids[start:start + self.SCORE_CHUNK]
                out = torch.empty((len(chunk), self.vocab_size), dtype=torch.float32)
                self._decode_rows([(self._scratch, start, chunk, len(chunk))], out, 0)
                yield out
        finally:
            self._remove(self._scratch, 0)

    def _decode_rows(self, spans: list[tuple[int, int, list[int], int]], out: torch.Tensor | None, dest) -> None:
        """Decode spans (seq, first position, tokens, logits wanted at its last n) in as few
        llama_decode calls as n_batch allows, in order; the wanted logits go to out[dest[i]] in
        span order (dest: indices, or the first row of out for consecutive rows). On failure every
        span's sequence is rolled back to its first position and RuntimeError is raised."""
        lib, batch = self._lib, self._batch
        tokens = np.concatenate([np.asarray(ids, dtype=np.int32) for _, _, ids, _ in spans])
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.num_embeddings):
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got {int(tokens.min())}.."
                             f"{int(tokens.max())}")
        pos = np.concatenate([np.arange(first, first + len(ids), dtype=np.int32) for _, first, ids, _ in spans])
        seq = np.concatenate([np.full(len(ids), s, dtype=np.int32) for s, _, ids, _ in spans])
        wanted = np.concatenate([np.arange(len(ids)) >= len(ids) - n for _, _, ids, n in spans])
        dest = torch.as_tensor(dest, dtype=torch.long) if not isinstance(dest, int) else dest
        done = 0  # outputs copied so far
        try:
            for start in range(0, tokens.size, batch.capacity):
                end = min(start + batch.capacity, tokens.size)
                n = end - start
                batch.token[:n], batch.pos[:n], batch.seq[:n] = tokens[start:end], pos[start:end], seq[start:end]
                batch.logits[:n] = wanted[start:end]
                batch.struct.n_tokens = n
                code = lib.llama_decode(self._ctx, batch.struct)
                if code != 0:
                    raise RuntimeError(f"llama_decode failed with code {code} on {n} tokens"
                                       f"{' (no KV cell free)' if code == 1 else ''}")
                outputs = int(wanted[start:end].sum())
                if outputs:
                    pointer = lib.llama_get_logits(self._ctx)
                    logits = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(outputs, self.vocab_size)))
                    if isinstance(dest, int):
                        out[dest + done:dest + done + outputs] = logits
                    else:
                        out[dest[done:done + outputs]] = logits
                    done += outputs
        except BaseException:
            for s, first, _, _ in spans:
                self._lib.llama_memory_seq_rm(self._memory, s, first, -1)
            raise

    # --- the vocabulary ----------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids llama.cpp ends generation on (llama_vocab_is_eog: EOS, EOT and the like)."""
        if self._eog is None:
            self._eog = frozenset(t for t in range(self.vocab_size) if self._lib.llama_vocab_is_eog(self._vocab, t))
        return self._eog

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's own tokenization of text (no BOS added; special tokens parsed when asked)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        ids = (self._lib.llama_token * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), ids, capacity, False, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens for {len(data)} bytes")
        return list(ids[:n])

    @property
    def description(self) -> str:
        """llama.cpp's one-line description of the model: architecture, size and weight type
        (e.g. "qwen2 1.5B Q4_K - Medium")."""
        buffer = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_desc(self._model, buffer, len(buffer))
        return buffer.value.decode("utf-8", "replace") if n >= 0 else self.path.name

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (e.g. "general.architecture"), or None."""
        buffer = ctypes.create_string_buffer(4096)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode("utf-8", "replace") if n >= 0 else None


# --- loading --------------------------------------------------------------------------------------------

def load_gguf(path, **options) -> tuple[LlamaCppLM, object]:
    """A GGUF file → (llama.cpp backend, transformers tokenizer built from the same file).

    options: LlamaCppLM's (n_ctx, max_rows, n_threads, n_batch, n_ubatch, kv_type, flash_attn, grow).
    Raises:
        ImportError: llama-cpp-python missing.  FileNotFoundError: no such file.
        ValueError: the tokenizer has more ids than the model's vocabulary, or tokenizes a probe
            text differently from llama.cpp (not the same vocabulary).
    """
    backend = LlamaCppLM(path, **options)
    tokenizer = gguf_tokenizer(path)
    if len(tokenizer) > backend.vocab_size:
        raise ValueError(f"{Path(path).name}: its tokenizer has {len(tokenizer)} ids, llama.cpp's vocabulary "
                         f"{backend.vocab_size}")
    probe = "def f(x):\n    return x * 2  # hello, world"
    ours = tokenizer(probe, add_special_tokens=False).input_ids
    if ours != backend.tokenize(probe):
        raise ValueError(f"{Path(path).name}: transformers and llama.cpp tokenize {probe!r} differently "
                         f"({ours} vs {backend.tokenize(probe)})")
    return backend, tokenizer
