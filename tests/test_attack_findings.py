"""Bugs found by a hostile pass over DecoderConfig, the llama.cpp backend, the CLI and the server
on tiny random GGUF files (specdecode.models.tiny_gguf's builder). Each test failed until its
bug was fixed."""

import argparse
import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python==0.3.36")

from specdecode import SpeculativeDecoder  # noqa: E402
from specdecode.cli import main  # noqa: E402
from specdecode.cli.common import as_flags, served_name  # noqa: E402
from specdecode.config import DecoderConfig  # noqa: E402
from specdecode.models.llamacpp import LlamaCppLM  # noqa: E402
from specdecode.models.loading import check_model_spec  # noqa: E402
from specdecode.models.tiny_gguf import build_tiny  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cache(module_cache):
    return module_cache


@pytest.fixture
def corrupt(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"not a gguf file at all")
    return str(path)


def test_cli_refuses_a_corrupt_gguf_with_one_line_and_exit_2(corrupt, capsys):
    # was: an uncaught RuntimeError("llama.cpp could not load ...") traceback, exit status 1
    # (the same from `serve`; also for a truncated or empty .gguf file)
    code = main(["generate", "hi", "--quiet", "--target", corrupt, "--draft", "none", "--dtype", "gguf"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("specdecode generate: error:")]


def test_cli_refuses_a_corrupt_gguf_draft_with_exit_2(gguf, corrupt, capsys):
    code = main(["generate", "hi", "--quiet", "--target", gguf["target"], "--draft", corrupt, "--dtype", "gguf",
                 "--quantize-draft", "gguf"])
    assert code == 2 and "Traceback" not in capsys.readouterr().err


def test_a_failed_llamacpp_load_leaves_no_error_in_del(tmp_path, monkeypatch):
    # was: "Exception ignored in LlamaCppLM.__del__ ... AttributeError: no attribute '_lib'" on
    # stderr after every refused path (e.g. `--target dir.gguf` where dir.gguf is a directory)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(FileNotFoundError):
        LlamaCppLM(tmp_path / "missing.gguf")
    with pytest.raises(ValueError):
        LlamaCppLM(build_tiny(tmp_path)["target"], n_ctx=0)
    gc.collect()
    assert [repr(u.exc_value) for u in unraisable] == []


def test_a_batch_limit_llama_cpp_cannot_hold_is_refused_clearly(gguf):
    # was: RuntimeError "llama.cpp could not create a context of 4096 cells ... (out of memory?)"
    # after loading (llama.cpp: n_seq_max must be <= 256); `serve --max-batch-size 300` crashed
    with pytest.raises(ValueError, match="max_batch_size must be <= 255"):
        SpeculativeDecoder(gguf["target"], None, backend="llama.cpp", dtype="float32", max_batch_size=300)
    with pytest.raises(ValueError, match="max_batch_size must be <= 255"):
        DecoderConfig(gguf["target"], gguf["draft"], quantize_draft="gguf", max_batch_size=256).validate()
    # dtype="auto" leaves llama.cpp out of the candidates for such a batch
    import specdecode.tune as tune

    targets, kinds = tune.candidates_of(DecoderConfig(gguf["target"], gguf["draft"], max_batch_size=300), "int4")
    assert targets and not any(t.startswith("llama.cpp") for t in targets) and "gguf" not in kinds
    targets, kinds = tune.candidates_of(DecoderConfig(gguf["target"], gguf["draft"]), "int4")
    assert any(t.startswith("llama.cpp") for t in targets) and "gguf" in kinds


def test_served_name_of_a_gguf_path_does_not_show_the_file_system(gguf):
    # --served-model-name's help: "default: the --target value, a path's last part only: the server
    # does not show its file system"; a GGUF file path was served (and echoed in 404s) in full
    args = argparse.Namespace(served_model_name=None, target=gguf["target"])
    assert served_name(args) == os.path.basename(gguf["target"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="bench needs matplotlib")
def test_bench_refuses_a_llama_cpp_target_before_loading_models(gguf, tmp_path, monkeypatch):
    # --dtype gguf puts the target on llama.cpp, which bench refuses; it loaded and timed both
    # models (and the draft a second time through transformers) for ~30 s before saying so
    import specdecode.cli.bench as bench

    monkeypatch.setattr(bench, "build_decoder", lambda *a, **k: pytest.fail("loaded models before refusing"))
    try:
        code = main(["bench", "--quick", "--quiet", "--tasks", "translation", "--target", gguf["target"], "--draft",
                     gguf["draft"], "--dtype", "gguf", "--out", str(tmp_path / "bench")])
    except SystemExit as stop:
        code = stop.code
    assert code == 2


@pytest.mark.parametrize("field", ["guard", "use_generation_config"])
def test_a_boolean_option_refuses_a_string(field):
    # guard="no" / guard="off" validated and meant guard ON (a truthy string)
    with pytest.raises((ValueError, TypeError)):
        DecoderConfig(**{field: "no"}).validate()


def test_an_existing_file_that_is_not_a_model_is_not_said_not_to_exist(gguf, tmp_path):
    # a GGUF file named without ".gguf": "model path ... does not exist" although it exists
    path = tmp_path / "tiny.bin"
    path.write_bytes(Path(gguf["target"]).read_bytes())
    with pytest.raises(ValueError) as info:
        check_model_spec(str(path))
    assert "does not exist" not in str(info.value)


def test_a_gguf_path_with_a_tilde_is_found(gguf, tmp_path, monkeypatch):
    # gguf_source() expands "~", but check_model_spec refuses first: "GGUF file '~/x.gguf' does not exist"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(Path(gguf["target"]).read_bytes())
    check_model_spec("~/x.gguf")


def test_cli_message_names_flags_not_keyword_syntax():
    # `--quantize-draft gguf --device-map auto` printed "... without device= or --device-map="
    message = as_flags(str(pytest.raises(ValueError, DecoderConfig(quantize_draft="gguf",
                                                                      device_map="auto").validate).value))
    assert "--device-map=" not in message and "device=" not in message


def test_an_unknown_prompt_lookup_value_names_the_option_given():
    # was: a DeprecationWarning "prompt_lookup='bogus' is now free_drafts='bogus'", then an error
    # about free_drafts, an option the caller never gave
    with pytest.raises(ValueError, match=r"prompt_lookup \(now free_drafts\)"):
        DecoderConfig.from_options(prompt_lookup="bogus")
