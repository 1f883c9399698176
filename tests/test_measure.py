"""`specdecode alpha` and `specdecode bench` on table and tiny models: the recorded p is the
target's, the two ways of measuring α agree, and the commands write their reports."""

import json

import pytest
import torch

from specdecode import SamplingParams
from specdecode.measure.alpha import RecordingBackend, bootstrap_ratio, measure_task, summarize
from specdecode.analysis import acceptance_rate
from specdecode.cli import main
from specdecode.engine.driver import run
from specdecode.engine.request import DecodeConfig
from specdecode.models import TableModel
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import adjust

from helpers import tiny_llama


def test_recording_backend_keeps_the_p_each_committed_token_was_drawn_from():
    target, draft = TableModel(6, seed=0), TableModel(6, seed=1)
    recorder = RecordingBackend(target)
    result = run(recorder, DraftModelProposer(draft), [1, 2],
                 DecodeConfig(max_new_tokens=60, sampling=SamplingParams(seed=0), num_speculative_tokens=3))
    sequence = [1, 2] + result.token_ids
    for j in range(2, len(sequence)):  # the row that predicted token j came after tokens[:j]
        assert torch.equal(recorder.logits[j], target.logits_for(sequence[:j]))
    assert sorted(recorder.logits) == list(range(2, len(sequence)))  # nothing past the committed text


def test_paper_way_alpha_and_empirical_alpha_agree_on_a_table_pair():
    target, draft = TableModel(6, seed=0, sharpness=1.5), TableModel(6, seed=1, sharpness=1.5)
    sampling = SamplingParams(temperature=1.0)
    records = measure_task(target, draft, [[1, 2], [3, 4], [0, 5], [2, 2]], sampling, gamma=3,
                           max_new_tokens=300, eos_token_ids=frozenset())
    for rec in records:  # β of the draft model is Σ min(p, q) with both straight from the tables
        seq = rec.prompt_ids + rec.output_ids
        p = adjust(torch.stack([target.logits_for(seq[:j]) for j in range(2, len(seq))]), sampling)
        q = adjust(torch.stack([draft.logits_for(seq[:j]) for j in range(2, len(seq))]), sampling)
        assert torch.allclose(rec.betas["draft model"], acceptance_rate(p, q), atol=1e-6)
        assert torch.allclose(rec.betas["uniform"], acceptance_rate(p, torch.full_like(p, 1 / 6)), atol=1e-6)
    out = summarize(records, gamma=3)
    paper, emp = out["paper"]["draft model"], out["empirical"]
    assert out["tokens"] == 1200 and 0.3 < paper["alpha"] < 0.95
    # both estimate E[β] over the target's text; with ~800 verified drafts their gap is noise
    assert abs(emp["alpha"] - paper["alpha"]) < 0.06
    assert paper["ci95"][0] <= paper["alpha"] <= paper["ci95"][1]
    assert emp["accepted_over_drafted"] < emp["alpha"]


def test_greedy_alpha_is_the_rate_at_which_the_argmaxes_agree():
    target, draft = TableModel(5, seed=3), TableModel(5, seed=4)
    records = measure_task(target, draft, [[1, 2]], SamplingParams(temperature=0), gamma=2,
                           max_new_tokens=40, eos_token_ids=frozenset())
    seq = records[0].prompt_ids + records[0].output_ids
    agree = [float(target.logits_for(seq[:j]).argmax() == draft.logits_for(seq[:j]).argmax()) for j in range(2, len(seq))]
    assert records[0].betas["draft model"].tolist() == agree


def test_bootstrap_interval_contains_the_estimate_and_shrinks_with_more_prompts():
    few = bootstrap_ratio([5, 7, 6], [10, 10, 10])
    many = bootstrap_ratio([5, 7, 6] * 20, [10, 10, 10] * 20)
    assert few[0] == pytest.approx(0.6) and few[1] <= 0.6 <= few[2]
    assert many[2] - many[1] < few[2] - few[1]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, request):
    tokenizer = request.getfixturevalue("char_tokenizer")
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama(0, vocab=len(tokenizer))
    draft = tiny_llama(0, vocab=len(tokenizer))
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.01 * torch.randn_like(param))
    for name, model in (("target", target), ("draft", draft)):
        model.config.max_position_embeddings = 2048  # character-level HumanEval prompts are long
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.mark.slow
def test_alpha_command_writes_its_report(pair_dirs, tmp_path, capsys):
    out = tmp_path / "alpha"
    assert main(["alpha", "--quick", "--target", pair_dirs[0], "--draft", pair_dirs[1], "--dtype", "float32",
                 "--quiet", "-k", "3", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["task"], r["temperature"]) for r in data["results"]] == \
        [("code", 0.0), ("code", 1.0), ("translation", 0.0), ("translation", 1.0)]
    for r in data["results"]:
        uniform = {"uniform"} if r["temperature"] > 0 else set()  # greedy "uniform" would be token 0
        assert set(r["paper"]) == {"draft model", "bigram", "unigram", "prompt lookup"} | uniform
        assert 0 <= r["paper"]["draft model"]["alpha"] <= 1 and r["empirical"]["gamma"] == 3
    assert (tmp_path / "alpha_alpha.png").stat().st_size > 0
    assert "α the paper's way" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_command_writes_its_report(pair_dirs, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--target", pair_dirs[0], "--draft", pair_dirs[1], "--dtype", "float32",
                 "--quiet", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert rows["transformers generate, target alone"]["speedup"]["all"] == 1.0
    assert {"specdecode plain", "specdecode γ=2", "specdecode γ=4", "specdecode as configured",
            "prompt lookup alone", "transformers assisted, heuristic, float draft",
            "transformers assisted, constant:4, float draft"} <= set(rows)
    # float32 greedy: every configuration emits the target's own greedy tokens
    assert all(r["same_tokens_as_plain"] == 2 and r["same_tokens_as_hf"] == 2 for r in data["rows"])
    assert rows["specdecode γ=4"]["predicted"] > 0 and data["costs"]["c"] > 0 and data["theory"]["optimal_gamma"] >= 1
    for figure in ("speedup_vs_gamma", "expected_tokens", "optimal_gamma"):
        assert (tmp_path / f"bench_{figure}.png").stat().st_size > 0


@pytest.mark.parametrize("args,match", [(["bench", "--hf-assisted", "constant:x"], "hf-assisted"),
                                        (["bench", "--gammas", "0"], "gammas"),
                                        (["bench", "--hf-assisted", "constant:4@ours"], "hf-assisted"),
                                        (["alpha", "--temperatures", "-1"], "temperatures"),
                                        (["alpha", "--tasks", "poetry"], "invalid choice")])
def test_measurement_usage_errors_exit_2(args, match, capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_info:
        main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.slow
def test_bench_lenience_and_batch_rows(pair_dirs, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--target", pair_dirs[0], "--draft", pair_dirs[1], "--dtype", "float32",
                 "--quiet", "--hf-assisted", "constant:2@ours", "--hf-draft", "float", "ours", "--headline",
                 "--gammas", "2", "--lenience", "0.3",
                 "--batch-size", "1", "2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    lenient = rows["specdecode γ=4, lenience 0.3 (lossy)"]
    assert lenient["alpha_hat"] >= rows["specdecode γ=2"]["alpha_hat"] - 0.05
    assert set(rows) == {"transformers generate, target alone", "specdecode γ=2", "specdecode γ=4",
                         "specdecode γ=4, lenience 0.3 (lossy)", "specdecode as configured",
                         "transformers assisted, constant:2, ours draft"}
    assert [(b["batch_size"], b["method"]) for b in data["batch"]] == \
        [(1, "plain"), (1, "speculative"), (2, "plain"), (2, "speculative")]
    assert "lossy" in out.with_suffix(".md").read_text()


def test_lenient_alpha_is_the_papers_formula_and_grows_as_l_falls():
    from specdecode.measure.alpha import lenient_beta

    p = torch.tensor([[0.1, 0.6, 0.3]])
    q = torch.tensor([[0.5, 0.3, 0.2]])
    assert lenient_beta(p, q, p, 1.0, greedy=False).item() == pytest.approx(0.6)  # Σ min(p, q)
    assert lenient_beta(p, q, p, 0.5, greedy=False).item() == pytest.approx(0.2 + 0.3 + 0.2)  # Σ min(p/l, q)
    one_hot = torch.tensor([[1.0, 0.0, 0.0]])  # the greedy draft proposes token 0: p = 0.1 = max p / 6
    assert lenient_beta(p, one_hot, p, 0.2, greedy=True).item() == 0.0
    assert lenient_beta(p, one_hot, p, 0.1, greedy=True).item() == 1.0
    target, draft = TableModel(6, seed=0), TableModel(6, seed=1)
    records = measure_task(target, draft, [[1, 2]], SamplingParams(temperature=1.0), gamma=3, max_new_tokens=100,
                           eos_token_ids=frozenset(), lenience=(0.5, 0.1))
    alphas = summarize(records, 3)["paper"]
    assert alphas["draft model"]["alpha"] < alphas["draft model, l=0.5 (lossy)"]["alpha"] \
        < alphas["draft model, l=0.1 (lossy)"]["alpha"]


def test_bench_masks_eos_on_our_side_as_transformers_min_new_tokens_does():
    from specdecode.measure.bench import NoEOS

    target = TableModel(6, seed=0)
    masked = NoEOS(target, {2, 9})
    masked.add_row()
    logits = masked.forward([[1, 2, 3]], 2)[0]
    assert torch.isinf(logits[:, 2]).all() and torch.isfinite(logits[:, [0, 1, 3, 4, 5]]).all()
    assert masked.lengths == [3] and masked.vocab_size == 6


def test_report_paths_may_contain_dots(tmp_path):
    from specdecode.measure.report import write

    json_path, md_path = write(tmp_path / "t0.5", "title", {"command": "x", "a": 1}, ["body"], {"rows": []})
    assert json_path.name == "t0.5.json" and md_path.name == "t0.5.md" and "body" in md_path.read_text()


def test_missing_bench_extras_fail_before_any_model_loads(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    for command in ("alpha", "bench"):
        with pytest.raises(SystemExit, match="^2$") as exit_info:
            main([command, "--target", "/nonexistent"])
        assert exit_info.value.code == 2 and "specdecode[bench]" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_compare_verification_rows(pair_dirs, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--prompts", "1", "--new-tokens", "8", "--repeats", "1", "--target", pair_dirs[0],
                 "--draft", pair_dirs[1], "--dtype", "float32", "--quiet", "--headline", "--hf-assisted", "none",
                 "--gammas", "2", "--compare-verification", "--tree-widths", "2",
                 "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["verification"] == "token"
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"transformers generate, target alone", "specdecode γ=2", "specdecode γ=2, block verification",
                         "specdecode as configured", "specdecode as configured, block verification",
                         "specdecode as configured, drafter-invariant verification",
                         "specdecode as configured, tree width 2"}
    # float32 greedy: the block rule, the race (argmax when greedy) and the tree emit the target's own
    # greedy tokens too
    assert all(r["same_tokens_as_hf"] == 1 for r in data["rows"])
