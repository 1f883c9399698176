"""GGUF files through the facade and the CLI: SpeculativeDecoder(target="x.gguf", ...) on the
llama.cpp backend (dtype="gguf": the file's own numbers; backend="llama.cpp": a converted BF16 or
F32 file), what configuration() reports, what is refused, and dtype="auto" timing llama.cpp
candidates beside torch's. Tiny random Qwen2-architecture GGUFs (specdecode.models.tiny_gguf's
builder); the backend itself is tested in test_llamacpp.py."""

import json

import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python==0.3.36")

import specdecode.tune as tune  # noqa: E402
from specdecode import SamplingParams, SpeculativeDecoder  # noqa: E402
from specdecode.cli import main  # noqa: E402
from specdecode.models.llamacpp import LlamaCppLM  # noqa: E402
from specdecode.config import DecoderConfig  # noqa: E402
from specdecode.tune import candidates, hardware  # noqa: E402
from specdecode.tune.cache import save_choice  # noqa: E402
from specdecode.tune.costs import Choice  # noqa: E402

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[5, 17, 33, 2, 71, 40, 8], [300, 12, 9], [44, 260, 261, 262, 11, 90, 91, 92, 93, 7, 7]]


@pytest.fixture(scope="module", autouse=True)
def cache(module_cache):
    """A cache folder of this module's own (converted files, tokenizers, choices)."""
    return module_cache


def _chosen(choice: Choice, target, draft, **options) -> None:
    """What dtype="auto"/"gguf" will load: a choice in the cache (the tiny pair's own timings choose
    plain decoding: its draft costs as much as its target)."""
    save_choice(tune.choice_key(DecoderConfig(target=target, draft=draft, **options)), choice)


def test_a_gguf_pair_in_its_own_numbers_runs_on_llama_cpp_and_greedy_equals_plain(gguf):
    options = dict(dtype="gguf", quantize_draft="gguf")
    _chosen(Choice("llama.cpp-gguf", "gguf", "llama.cpp", 4, 10.0, 5.0), gguf["target"], gguf["draft"], **options)
    spec = SpeculativeDecoder(gguf["target"], gguf["draft"], guard=False, free_drafts="off", **options)
    plain = SpeculativeDecoder(gguf["target"], None, dtype="gguf")
    assert isinstance(spec.target.backend, LlamaCppLM) and isinstance(spec.draft.backend, LlamaCppLM)
    configuration = spec.configuration()
    assert configuration["backend"] == "llama.cpp" and configuration["dtype"] == "gguf"
    assert configuration["target_kernel"] == "llama.cpp-gguf" and "GGUF" in configuration["target_weights"]
    assert configuration["draft_dtype"] == "gguf" and "GGUF" in configuration["draft_weights"]
    drafted = 0
    for prompt in PROMPTS:
        got = spec.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        # F32 weights: a k-token call rounds like a one-token one to well below any top-2 margin here
        assert got.token_ids == plain.generate(prompt, max_new_tokens=24, sampling=GREEDY).token_ids
        drafted += got.stats.num_drafted
    assert drafted > 0
    assert spec.generate("hello", max_new_tokens=8, sampling=GREEDY, chat=False).text  # the GGUF's tokenizer


def test_backend_llama_cpp_converts_the_file_to_the_asked_numbers_once(gguf, cache):
    bf16 = SpeculativeDecoder(gguf["target"], gguf["draft"], backend="llama.cpp", dtype="bfloat16")
    assert bf16.configuration()["target_kernel"] == "llama.cpp-bf16" and bf16.pair.dtype == torch.bfloat16
    assert "BF16" in bf16.configuration()["target_weights"]
    assert bf16.configuration()["draft_weights"].endswith("GGUF")  # the draft's file as it is
    f32 = SpeculativeDecoder(gguf["target"], None, backend="llama.cpp", dtype="float32")
    assert f32.configuration()["target_kernel"] == "llama.cpp-f32"
    converted = sorted(p.name for p in (cache / "gguf").glob("*.gguf"))
    assert [name.rsplit("-", 2)[1] for name in converted] == ["bf16", "f32"]  # NAME-KIND-DIGEST.gguf
    SpeculativeDecoder(gguf["target"], None, backend="llama.cpp")  # reused, not converted again
    assert sorted(p.name for p in (cache / "gguf").glob("*.gguf")) == converted


def test_a_llama_cpp_target_with_a_torch_draft_keeps_the_distribution_exact_when_greedy(gguf):
    options = dict(dtype="gguf", quantize_draft="none")
    _chosen(Choice("llama.cpp-gguf", "none", "bfloat16", 4, 10.0, 5.0), gguf["target"], gguf["draft"], **options)
    spec = SpeculativeDecoder(gguf["target"], gguf["draft"], guard=False, free_drafts="off", **options)
    assert isinstance(spec.target.backend, LlamaCppLM) and not isinstance(spec.draft.backend, LlamaCppLM)
    plain = SpeculativeDecoder(gguf["target"], None, dtype="gguf")
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=16, sampling=GREEDY).token_ids == \
            plain.generate(prompt, max_new_tokens=16, sampling=GREEDY).token_ids


@pytest.mark.parametrize("options,match", [
    (dict(dtype="gguf", tree_width=2), "token trees"),
    (dict(backend="llama.cpp", dtype="float16"), "torch dtype"),
    (dict(dtype="gguf", backend="torch"), "only the llama.cpp backend runs"),
    (dict(quantize_draft="gguf", device="cuda"), "on llama.cpp, on the CPU"),
])
def test_what_llama_cpp_cannot_do_is_refused_before_loading(gguf, options, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(gguf["target"], gguf["draft"], **options)


def test_a_directory_target_on_llama_cpp_is_refused_with_what_to_do(model_dirs):
    with pytest.raises(ValueError, match="not a GGUF file or a zoo name"):
        SpeculativeDecoder(model_dirs["target"], None, backend="llama.cpp")


def test_auto_times_llama_cpp_beside_torch_and_loads_what_it_chose(gguf, monkeypatch):
    monkeypatch.setattr(candidates, "AUTO_MIN_PARAMETERS", 0)
    monkeypatch.setattr(hardware, "BUSY_CORES", float("inf"))  # cached whatever else runs here
    lines = []
    decoder = SpeculativeDecoder(gguf["target"], gguf["draft"], progress=lines.append)
    notes = "\n".join(decoder.plan.choice.notes)
    assert "llama.cpp-bf16 target: step" in notes and "bfloat16 target: step" in notes
    assert "gguf llama.cpp draft: step" in notes and "int4 bfloat16 draft: step" in notes
    assert any(line.startswith("chose for this machine") for line in lines)
    assert decoder.configuration()["target_kernel"] == decoder.plan.choice.target_kernel
    assert decoder.configuration()["backend"] == ("llama.cpp" if decoder.plan.choice.target_kernel.startswith("llama")
                                                  else "torch")
    monkeypatch.setattr(tune, "measure_and_choose", lambda *a, **k: pytest.fail("measured again"))
    again = SpeculativeDecoder(gguf["target"], gguf["draft"])
    assert again.plan.choice == decoder.plan.choice


def test_the_choice_cache_key_names_the_llama_cpp_build(gguf, monkeypatch):
    # an AVX2-only build of llama.cpp runs other kernels: its timings are not this build's
    from specdecode.models import llamacpp

    config = DecoderConfig(gguf["target"], gguf["draft"])
    torch_only = DecoderConfig(gguf["target"], gguf["draft"], backend="torch", quantize_draft="int4")
    keys = tune.choice_key(config), tune.choice_key(torch_only)
    monkeypatch.setattr(llamacpp, "system_info", lambda: "CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 |")
    assert tune.choice_key(config) != keys[0]
    assert tune.choice_key(torch_only) == keys[1]  # no llama.cpp candidate: its build does not matter


def test_cli_generates_from_gguf_files_and_reports_the_backend(gguf, capsys):
    code = main(["generate", "hello", "--raw", "--target", gguf["target"], "--draft", gguf["draft"], "--dtype",
                 "gguf", "--temperature", "0", "--max-new-tokens", "6", "--json", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["configuration"]["backend"] == "llama.cpp"
    assert len(out["token_ids"]) <= 6


def test_cli_refuses_a_missing_gguf_file_with_exit_2(capsys, tmp_path):
    code = main(["generate", "hi", "--target", str(tmp_path / "missing.gguf"), "--dtype", "gguf"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
