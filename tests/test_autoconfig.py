"""dtype="auto": what is timed, what is chosen and cached, and what is never changed. Tiny models
(AUTO_MIN_PARAMETERS lowered so that they are timed); the choice's logic itself is in
test_choice.py."""

import pytest
import torch

import specdecode.tune as tune
from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.config import DecoderConfig
from specdecode.models import packed
from specdecode.tune import cache as choice_cache
from specdecode.tune import candidates, hardware
from specdecode.tune.costs import Choice

GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def timed_when_tiny(monkeypatch):
    monkeypatch.setattr(candidates, "AUTO_MIN_PARAMETERS", 0)
    # whatever else runs on this machine, these tests' choices are cached (the busy case below)
    monkeypatch.setattr(hardware, "BUSY_CORES", float("inf"))


ALL_KINDS = ("int4", "int8", "none")


def _key(model_dirs, gamma: int = 8) -> str:
    return tune.choice_key(DecoderConfig(model_dirs["target"], model_dirs["draft"], num_speculative_tokens=gamma))


def _cached(model_dirs, choice: Choice, gamma: int = 8) -> None:
    choice_cache.save_choice(_key(model_dirs, gamma), choice)


def test_auto_times_the_pair_once_and_a_second_start_reuses_the_choice(model_dirs, cache, timed_when_tiny,
                                                                       monkeypatch):
    lines = []
    first = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], progress=lines.append)
    assert first.plan.choice is not None and first.plan.choice.notes  # what was measured, per target kernel
    assert any(line.startswith("chose for this machine") and hardware.cpu_report()["capability"] in line
               and len(line) < 250 for line in lines)
    assert list((cache / "choices").glob("*.json"))
    # every draft kernel the default allows, in every dtype (the float draft in bfloat16 only; the
    # integer kernels' float32 form only where bfloat16 products are not native)
    for kind in ALL_KINDS:
        for dtype in ("bfloat16", "bfloat16-gemv", "bfloat16-sdpa", "float32"):
            timed = any(note.startswith(f"{kind} {dtype} draft: step") for note in first.plan.choice.notes)
            # SDPA is timed where the prepared draft runs eager attention (the quantized ones)
            expected = kind != "none" or dtype not in ("float32", "bfloat16-sdpa")
            if dtype == "float32" and hardware.native_bfloat16():
                expected = False
            assert timed == expected

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(tune, "measure_and_choose", no_measuring)
    second = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert second.plan.choice == first.plan.choice and second.pair.dtype == first.pair.dtype
    configuration = second.configuration()
    assert configuration["dtype"] == str(second.pair.dtype).removeprefix("torch.")
    assert configuration["machine"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert configuration["choice"]["summary"] == first.plan.choice.describe() and configuration["choice"]["prior"] is False


@pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN packed linear")
def test_a_float32_choice_loads_float32_with_packed_linears_and_greedy_equals_plain_float32(
        model_dirs, cache, timed_when_tiny):
    _cached(model_dirs, Choice("float32-packed", "int4", "bfloat16-gemv", 3, 10.0, 5.0))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert decoder.pair.dtype == torch.float32 and decoder.num_speculative_tokens == 3
    assert decoder.pair.draft_dtype == torch.bfloat16 and not decoder.draft.backend.one_row_onednn
    assert decoder.target.backend.one_row_onednn
    assert any(isinstance(m, packed.PackedLinear) for m in decoder.target.backend.model.modules())
    assert decoder.configuration()["target_kernel"] == "float32-packed"
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="float32")
    for prompt in ("abcab", "hgfe d", "a"):
        got = decoder.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=24, sampling=GREEDY).token_ids
        assert got.stats.num_drafted > 0


def test_a_gemv_choice_runs_one_row_calls_of_both_models_without_onednn(model_dirs, cache, timed_when_tiny):
    _cached(model_dirs, Choice("bfloat16-gemv", "int4", "bfloat16-gemv", 6, 10.0, 5.0))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert decoder.pair.dtype == torch.bfloat16 and decoder.num_speculative_tokens == 6
    assert not decoder.target.backend.one_row_onednn and not decoder.draft.backend.one_row_onednn
    assert decoder.generate("abcab", max_new_tokens=12, sampling=GREEDY).stats.num_drafted > 0


def test_an_sdpa_choice_runs_the_drafts_steps_with_sdpa_and_greedy_equals_plain(model_dirs, cache, timed_when_tiny):
    _cached(model_dirs, Choice("bfloat16", "int4", "bfloat16-sdpa", 4, 10.0, 5.0))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert decoder.pair.draft_dtype == torch.bfloat16 and decoder.draft.backend.one_row_onednn
    assert not decoder.draft.backend.eager_attention
    assert SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="bfloat16").draft.backend.eager_attention
    got = decoder.generate("abcab", max_new_tokens=16, sampling=GREEDY)
    plain = SpeculativeDecoder(model_dirs["target"], None, dtype="bfloat16").generate("abcab", max_new_tokens=16,
                                                                                       sampling=GREEDY)
    assert got.stats.num_drafted > 0 and got.token_ids == plain.token_ids


def test_a_plain_choice_loads_no_draft_and_keeps_only_the_free_drafts(model_dirs, cache, timed_when_tiny):
    _cached(model_dirs, Choice("bfloat16", None, None, 0, 5.0, 5.0))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert decoder.draft is None and decoder.pair.dtype == torch.bfloat16
    assert decoder.configuration()["free_drafts"] == "suffix"  # they cost no model
    assert "no draft model pays" in decoder.configuration()["choice"]["summary"]
    _cached(model_dirs, Choice("bfloat16", None, None, 0, 5.0, 5.0))
    plain = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], free_drafts="off")
    result = plain.generate("aaaaaaa", max_new_tokens=12, sampling=GREEDY)
    assert result.stats.num_drafted == 0 and result.stats.num_lookup_steps == 0
    assert plain.draft is None and plain.configuration()["num_speculative_tokens"] == 0


def test_an_explicit_dtype_is_honoured_and_nothing_is_timed(model_dirs, cache, timed_when_tiny, monkeypatch):
    monkeypatch.setattr(tune, "measure_and_choose", lambda *a, **k: pytest.fail("timed an explicit dtype"))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32")
    assert decoder.pair.dtype == torch.float32 and decoder.plan.choice is None
    assert decoder.configuration()["choice"] is None
    # float32 as asked, its products on packed weights (the same IEEE arithmetic)
    assert any(isinstance(m, packed.PackedLinear) for m in decoder.target.backend.model.modules()) \
        or not packed.available()


def test_a_model_object_is_never_changed_by_auto(model_dirs, char_tokenizer, cache, timed_when_tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(tune, "measure_and_choose", lambda *a, **k: pytest.fail("timed a model object"))
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    decoder = SpeculativeDecoder(model, None, tokenizer=char_tokenizer)
    assert decoder.plan.choice is None and all(type(m) is not packed.PackedLinear for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32


def test_small_models_keep_bfloat16_without_timing(model_dirs, cache, monkeypatch):
    monkeypatch.setattr(candidates, "time_interleaved", lambda *a, **k: pytest.fail("timed a tiny model"))
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert decoder.pair.dtype == torch.bfloat16 and decoder.plan.choice is None
    assert not list((cache / "choices").glob("*.json"))


def test_an_unreadable_cache_file_is_measured_again(model_dirs, cache, timed_when_tiny):
    key = _key(model_dirs)
    choice_cache.cache_path(key).parent.mkdir(parents=True)
    choice_cache.cache_path(key).write_text("{not json")
    assert choice_cache.load_choice(key) is None
    assert SpeculativeDecoder(model_dirs["target"], model_dirs["draft"]).plan.choice is not None
    assert choice_cache.load_choice(key) is not None


def test_a_choice_measured_while_other_processes_were_busy_is_provisional_and_timed_again_when_idle(
        model_dirs, cache, timed_when_tiny, monkeypatch):
    monkeypatch.setattr(hardware, "BUSY_CORES", -1.0)  # any other load counts as busy
    lines = []
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], progress=lines.append)
    assert decoder.plan.choice is not None and decoder.plan.choice.provisional and "provisional" in decoder.plan.choice.notes[-1]
    assert any("provisional" in line for line in lines)
    cached = choice_cache.load_choice(_key(model_dirs))
    assert cached is not None and cached.provisional  # kept: the next busy start times nothing
    timed = []
    monkeypatch.setattr(tune, "measure_and_choose", lambda *a, **k: timed.append(1))
    SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert not timed
    monkeypatch.setattr(hardware, "BUSY_CORES", 1e9)  # now idle: the provisional choice is timed again
    SpeculativeDecoder(model_dirs["target"], model_dirs["draft"])
    assert timed


def test_a_busy_measurement_keeps_a_timed_draft():
    from specdecode.tune.costs import DraftCost, TargetCost, choose

    targets = {"bfloat16": TargetCost(0.1, {2: 3.0, 9: 9.0}, 0.01)}  # verifies look dear under load
    drafts = {("int4", "bfloat16"): DraftCost(0.05, 0.005)}
    assert choose(targets, drafts).draft_kernel is None
    kept = choose(targets, drafts, allow_plain=False)
    assert kept.draft_kernel == "int4" and kept.gamma >= 1


def test_float32_candidates_work_on_a_model_transformers_marks_quantized():
    # a zoo model's first start loads it from GGUF, and transformers then refuses .float()
    from helpers import tiny_llama

    model = tiny_llama(0).to(torch.bfloat16)
    model.is_quantized, model.quantization_method = True, "gguf"
    with pytest.raises(ValueError):
        model.float()
    assert next(tune.float32(model).parameters()).dtype == torch.float32


def test_the_tune_command_times_again_and_prints_the_table(model_dirs, cache, timed_when_tiny, capsys):
    from specdecode.cli import main

    stale = Choice("bfloat16", None, None, 0, 1.0, 1.0, notes=("stale",))
    _cached(model_dirs, stale)
    assert main(["tune", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "target: step" in out and out.strip().splitlines()[-1].startswith("chose: ")
    assert choice_cache.load_choice(_key(model_dirs)).notes != ("stale",)  # replaced
    with pytest.raises(SystemExit, match="^2$"):
        main(["tune", "--dtype", "float32"])


@pytest.fixture
def zen4_class(monkeypatch):
    """This machine seen as the prior's class (AVX-512 BF16, no AMX, specdecode.native built for it)."""
    from specdecode import native
    from specdecode.tune import prior

    report = dict(hardware.cpu_report(), flags=["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"],
                  native_bfloat16=True, threads=2, emulated={})
    monkeypatch.setattr(prior, "cpu_report", lambda: report)
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "isa", lambda: "avx512-bf16")
    return report


def test_the_prior_decides_the_default_pair_on_its_class_without_timing_or_caching(cache, zen4_class, monkeypatch):
    """The zoo's default pair on an AVX-512 BF16 CPU without AMX: the first start decides from the
    prior in milliseconds (nothing timed, nothing cached), says so, and `specdecode tune` (measure_now)
    times anyway; elsewhere (AMX, another pair, an explicit dtype or γ the prior still prices) it
    does not apply or follows the decoder's options."""
    from specdecode.tune import prior

    def no_measuring(*args, **kwargs):
        raise AssertionError("timed although the prior covers this machine")
    monkeypatch.setattr(tune, "measure_and_choose", no_measuring)
    lines = []
    plan = tune.plan(DecoderConfig(), lines.append)
    choice = plan.choice
    assert choice.prior and choice.target_kernel == "bfloat16-invariant" and plan.gamma == choice.gamma == 8
    assert (choice.draft_kernel, choice.draft_dtype) == ("int4", "native") and choice.guard_costs(8) is not None
    assert any("prior" in line and "specdecode tune" in line for line in lines if line.startswith("chose"))
    assert not list(cache.glob("choices/*.json"))
    assert tune.plan(DecoderConfig(num_speculative_tokens=3)).choice.gamma <= 3

    timed = Choice("bfloat16", "int4", "bfloat16", 4, 9.0, 6.0, c=0.2, r=1.2, r2=1.05)
    monkeypatch.setattr(tune, "measure_and_choose", lambda *args, **kwargs: timed)
    assert tune.plan(DecoderConfig(), measure_now=True).choice == timed
    assert tune.plan(DecoderConfig()).choice == timed  # cached now: the measurement replaces the prior

    targets, kinds = ("bfloat16", "bfloat16-invariant"), ("int4", "int8", "none")
    assert prior.prior_choice(DecoderConfig(), targets, kinds) is not None
    assert prior.prior_choice(DecoderConfig(dtype="bfloat16"), targets, kinds) is None
    plain = prior.prior_choice(DecoderConfig(draft=None), targets, ())  # the same target, plain decoding
    assert plain.prior and plain.target_kernel == "bfloat16-invariant" and plain.draft_kernel is None
    assert prior.prior_choice(DecoderConfig(draft="qwen2.5-coder-1.5b-instruct"), targets, kinds) is None
    assert prior.prior_choice(DecoderConfig(draft_vocab_limit=1000), targets, kinds) is None
    assert prior.prior_choice(DecoderConfig(), ("bfloat16",), kinds) is None  # batch_invariant=False
    assert prior.prior_choice(DecoderConfig(num_speculative_tokens=12), targets, kinds) is None  # r(13) unmeasured
    for changed in ({"flags": zen4_class["flags"] + ["amx_tile", "amx_bf16"]}, {"threads": 8},
                    {"emulated": {"ATEN_CPU_CAPABILITY": "avx2"}}):
        monkeypatch.setattr(prior, "cpu_report", lambda: dict(zen4_class, **changed))
        assert prior.prior_choice(DecoderConfig(), targets, kinds) is None, changed
    # each miss says why, and the start says it before timing
    assert "(ATEN_CPU_CAPABILITY set)" in prior.prior_gap(DecoderConfig(), targets, kinds)
    monkeypatch.setattr(prior, "cpu_report", lambda: dict(zen4_class, flags=zen4_class["flags"] + ["amx_tile"]))
    assert "AMX" in prior.prior_gap(DecoderConfig(), targets, kinds)
    monkeypatch.setattr(prior, "cpu_report", lambda: dict(zen4_class, threads=8))
    assert "2 threads, not 8" in prior.prior_gap(DecoderConfig(), targets, kinds)
    assert "dtype 'auto' only" in prior.prior_gap(DecoderConfig(dtype="bfloat16"), targets, kinds)
    assert "γ = 8, not 12" in prior.prior_gap(DecoderConfig(num_speculative_tokens=12), targets, kinds)
    cache_dir = cache / "choices"
    for stale in cache_dir.glob("*.json"):
        stale.unlink()
    lines = []
    tune.plan(DecoderConfig(), lines.append)
    assert any(line.startswith("no measured prior for this machine (it was measured on 2 threads, not 8)")
               for line in lines), lines


def test_a_file_candidate_that_cannot_be_made_is_skipped_where_others_were_timed(model_dirs, timed_when_tiny):
    """llama.cpp's BF16 copy can fail (no room on disk for 3.6 GB): the torch targets timed before
    it still choose, the progress says why it was left out; with nothing else timed it raises."""
    import dataclasses

    config = DecoderConfig(model_dirs["target"], model_dirs["draft"])

    def no_room(kernel):
        raise ValueError(f"llama.cpp could not convert the file to bf16 ({kernel}: no room on disk)")
    loaders = dataclasses.replace(tune._loaders(config, model_dirs["target"], model_dirs["draft"]), file_target=no_room)
    lines = []
    choice = candidates.measure_and_choose(loaders, ("bfloat16", "llama.cpp-bf16"), ("int4",), 4, lines.append)
    assert choice.target_kernel.startswith("bfloat16")
    assert any("llama.cpp-bf16 not timed" in line and "no room" in line for line in lines)
    with pytest.raises(ValueError, match="no room"):
        candidates.measure_and_choose(loaders, ("llama.cpp-bf16",), ("int4",), 4)


def test_drafter_invariant_verification_times_only_batch_invariant_targets(monkeypatch):
    """Its promise (seeded tokens that depend neither on drafts nor on other requests) holds only on
    a batch-invariant target, with a draft or without: dtype="auto" then times those alone."""
    monkeypatch.setattr(tune, "_invariant_candidate", lambda config, device: True)
    for draft in ("default", None):
        every, _ = tune.candidates_of(DecoderConfig(draft=draft), "int4")
        assert "bfloat16" in every and "bfloat16-invariant" in every
        only, _ = tune.candidates_of(DecoderConfig(draft=draft, verification="drafter-invariant"), "int4")
        assert only == ("bfloat16-invariant",)
    monkeypatch.setattr(tune, "_invariant_candidate", lambda config, device: False)  # no kernels here: as before
    assert "bfloat16" in tune.candidates_of(DecoderConfig(verification="drafter-invariant"), "int4")[0]
