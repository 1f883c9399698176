"""One set of checks for every engine backend (specdecode.models.backend): the members the engine
calls exist, and rows behave as the protocol says: joining rows read alone, ragged feeds with
right-aligned logits, a row's logits independent of the other rows (within the backend's own
rounding), rollback by truncate, select keeping rows in order, reset."""

import pytest
import torch

from helpers import tiny_llama, tiny_t5
from specdecode import native
from specdecode.models import Backend, DecoderBackend, HFCausalLM, Seq2SeqLM, TableModel, TreeBackend, llamacpp
from specdecode.models.gguf_convert import converted_gguf
from specdecode.models.tiny_gguf import tiny_qwen2, tiny_vocabulary, write_gguf

PREFIX, OTHER = [5, 17, 33, 2, 8], [9, 44, 2]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, module_cache):
    """{"f32": a tiny Qwen2 F32 GGUF, "q4_k_m": llama.cpp's Q4_K_M of it (hidden 256)}."""
    root = tmp_path_factory.mktemp("protocol")
    tokens, merges = tiny_vocabulary(320)
    write_gguf(tiny_qwen2(5, len(tokens), hidden=256), tokens, merges, root / "tiny-f32.gguf")
    return {"f32": root / "tiny-f32.gguf", "q4_k_m": converted_gguf(root / "tiny-f32.gguf", "q4_k_m")}


def _hf():
    return HFCausalLM(tiny_llama(0))


def _invariant():
    if not native.available():
        pytest.skip("no C++ compiler for specdecode.native")
    backend = HFCausalLM(tiny_llama(0, hidden=128).bfloat16())
    backend.use_invariant_forward()
    return backend


def _kquant(files):
    if not native.available():
        pytest.skip("no C++ compiler for specdecode.native")
    from specdecode.models.kquant import kquant_model

    return kquant_model(files["q4_k_m"])


def _llama(files):
    return llamacpp.LlamaCppLM(files["f32"], max_rows=4)


def _seq2seq():
    return Seq2SeqLM(tiny_t5(0))


# name → (make backend (given the tiny GGUF files or not), tolerance of a row batched against alone)
BACKENDS = {"table": (lambda: TableModel(96, order=2), 0.0),
            "hf float32": (_hf, 1e-5),
            "hf bfloat16-invariant": (_invariant, 0.0),
            "gguf-invariant": (_kquant, 0.0),
            "llama.cpp": (_llama, 1e-3),
            "seq2seq": (_seq2seq, 1e-5)}
NEEDS_FILES = {"gguf-invariant", "llama.cpp"}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    make, tolerance = BACKENDS[request.param]
    if request.param in NEEDS_FILES:
        if not llamacpp.available():
            pytest.skip("llama-cpp-python is not installed")
        made = make(request.getfixturevalue("tiny_ggufs"))
    else:
        made = make()
    made.tolerance, made.seq2seq = tolerance, request.param == "seq2seq"
    yield made
    getattr(made, "close", lambda: None)()


def join(backend, prefix):
    """A row joining with prefix (an encoder–decoder row: prefix as its encoder input)."""
    if backend.seq2seq:
        backend.add_row(encoder_input_ids=prefix + [1])
    else:
        backend.add_row(prefix_ids=prefix)


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    if tolerance == 0:
        return torch.equal(a, b)
    return bool(((a - b).abs() <= tolerance * (1 + b.abs().max())).all())


def test_every_backend_declares_the_protocol(backend):
    assert isinstance(backend, Backend)
    assert isinstance(backend, DecoderBackend) != backend.seq2seq
    assert isinstance(backend.vocab_size, int) and backend.num_embeddings >= backend.vocab_size - 1000
    assert backend.max_rows is None or backend.max_rows >= 1
    if isinstance(backend, (TableModel, HFCausalLM)):
        assert isinstance(backend, TreeBackend)


def test_one_row_reads_rolls_back_and_reads_again(backend):
    join(backend, PREFIX)
    start = backend.lengths[0]
    logits = backend.forward([[7, 11, 3]], 3)
    assert logits.shape == (1, 3, backend.vocab_size) and backend.lengths == [start + 3]
    backend.truncate([start + 1])
    again = backend.forward([[11, 3]], 2)
    assert backend.lengths == [start + 3] and close(again[0], logits[0, 1:], backend.tolerance)
    backend.select([0])
    assert backend.num_rows == 1
    backend.reset()
    assert backend.num_rows == 0 and backend.lengths == []


def test_rows_are_ragged_right_aligned_and_independent_and_roll_back(backend):
    if backend.max_rows == 1:
        pytest.skip("this backend holds one row at a time (the engine queues the others)")
    join(backend, PREFIX)
    join(backend, OTHER)
    start = list(backend.lengths)
    both = backend.forward([[7, 11, 3], [4]], 3)
    assert both.shape == (2, 3, backend.vocab_size) and both.dtype == torch.float32
    assert backend.lengths == [start[0] + 3, start[1] + 1]
    # row 1 alone, read the same way, gives its logits (the last entry: right-aligned)
    backend.reset()
    assert backend.num_rows == 0
    join(backend, OTHER)
    alone = backend.forward([[4]], 1)[0, -1]
    assert close(both[1, -1], alone, backend.tolerance)
    # rollback: drop the token and feed it again
    backend.truncate([start[1]])
    assert backend.lengths == [start[1]]
    assert close(backend.forward([[4]], 1)[0, -1], alone, backend.tolerance)
    # select keeps rows in the order asked
    join(backend, PREFIX)
    backend.select([1, 0])
    assert backend.lengths == [start[0], start[1] + 1]
    backend.forward([[7, 11, 3], []], 3)
    backend.select([0])
    assert backend.num_rows == 1 and backend.lengths == [start[0] + 3]


def test_decoder_backends_fill_and_score_as_forward_reads(backend):
    if backend.seq2seq:
        pytest.skip("an encoder–decoder backend takes its input when the row joins")
    backend.add_row()
    backend.fill(0, PREFIX)
    after_fill = backend.forward([[7]], 1)[0, -1]
    scored = torch.cat(list(backend.score(PREFIX + [7])))
    assert scored.shape == (len(PREFIX) + 1, backend.vocab_size)
    assert close(scored[-1], after_fill, max(backend.tolerance, 1e-5 if backend.tolerance else 0.0))
