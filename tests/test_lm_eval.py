"""lm-evaluation-harness (`local-completions`) against `specdecode serve`, started as users start it,
scores exactly what lm-eval's own `hf` backend scores on the same target: every multiple-choice
loglikelihood (echo + prompt logprobs, a list of token-id prompts per request) within 1e-4 and the
same greedy flags, every generate-until answer identical (benchmarks/lm_eval/compare.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
if importlib.util.find_spec("tenacity") is None:
    pytest.skip("lm-eval's API models need its [api] extra (pip install -e '.[eval]')", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lm_eval"))
import compare  # noqa: E402


@pytest.mark.slow
def test_lm_eval_scores_through_the_server_equal_its_hf_backend(tmp_path, capsys):
    assert compare.main(["--tiny", str(tmp_path / "models"), "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "samples compared: 44; differences: 0" in out


def test_the_comparison_notices_a_changed_loglikelihood_or_answer():
    """The check has power: one loglikelihood moved by 1e-3, or one answer changed, is reported."""
    metrics = {"specdecode_mc": {"acc,none": 0.5}, "specdecode_gen": {"exact_match,strip": 0.0}}
    samples = {"specdecode_mc": [(0, [[["-3.25", "True"]], [["-4.5", "False"]]])],
               "specdecode_gen": [(0, [["7"]])]}
    assert compare.compare((metrics, samples), (metrics, samples), 1e-4) == []
    moved = {**samples, "specdecode_mc": [(0, [[["-3.249", "True"]], [["-4.5", "False"]]])]}
    assert len(compare.compare((metrics, moved), (metrics, samples), 1e-4)) == 1
    answered = {**samples, "specdecode_gen": [(0, [["8"]])]}
    assert len(compare.compare((metrics, answered), (metrics, samples), 1e-4)) == 1
    assert len(compare.compare(({**metrics, "specdecode_mc": {"acc,none": 0.25}}, samples), (metrics, samples),
                               1e-4)) == 1
