"""`specdecode batch --ray` on a local Ray cluster the command starts itself (127.0.0.1, no
dashboard): greedy records equal to the local run row for row, resuming the same way."""

import json
import re
from pathlib import Path

import pytest

from specdecode.cli import main

pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")

PROMPTS = ["abc", "hhh a", "the cafe", "bad bed", "ace", "dead beef", "gag", "fade"]


def models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--dtype", "float32", "--no-guard", "-k", "3",
            "--raw", "--temperature", "0", "--max-tokens", "12", "--max-batch-size", "3", "--quiet"]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().split("\n") if line]


@pytest.mark.slow
def test_ray_data_records_equal_the_local_run_and_resume_skips_written_ids(model_dirs, tmp_path, capfd):
    rows = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS)] + ["not json", {"prompt": "ace", "top_p": 2}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["batch", str(inp), "--output", str(local), *models(model_dirs)]) == 0
    # a crashed earlier run wrote two rows and half of a third
    lines = local.read_text().split("\n")
    on_ray.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:10])
    capfd.readouterr()
    loud = [flag for flag in models(model_dirs) if flag != "--quiet"]  # for the summary line
    assert main(["batch", str(inp), "--output", str(on_ray), *loud, "--ray", "--workers", "1",
                 "--rows-per-task", "4"]) == 0
    # the summary gives the job's time and, within it, the time the workers decoded
    summary = re.search(r"(\d+) tokens in ([\d.]+) s \([\d.]+ tokens/s\) \(([\d.]+) tokens/s over the ([\d.]+) s the "
                        r"workers decoded\)", capfd.readouterr().err)
    assert summary, "no summary line with the decoding time"
    tokens, wall, rate, decoding = int(summary[1]), float(summary[2]), float(summary[3]), float(summary[4])
    # (the decoding time prints rounded to 0.1 s, and tiny models decode in less; the rate uses
    # the unrounded time)
    assert decoding < wall and rate > tokens / wall
    expected = {json.dumps(r["id"]): r for r in read_jsonl(local)}
    got = read_jsonl(on_ray)
    assert len(got) == len(expected) == len(rows) and {json.dumps(r["id"]) for r in got} == set(expected)
    for record in got:
        want = expected[json.dumps(record["id"])]
        assert record.get("text") == want.get("text") and record.get("error") == want.get("error")
        assert record.get("usage") == want.get("usage")
