"""`specdecode batch` on tiny float32 models: one output line per input line, bad lines as errors,
greedy texts equal to decoding each prompt alone, and resuming after a crash (a half-written last
line, and a real SIGKILL mid-run) with every id exactly once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.cli import main
from specdecode.scale.journal import OutputJournal

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["abc", "hhh a", "the cafe", "bad bed", "ace", "dead beef", "gag", "fade"]


def models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--dtype", "float32", "--no-guard", "-k", "3"]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    # not splitlines(): a text may hold U+2028, which JSON leaves raw and splitlines splits at
    return [json.loads(line) for line in Path(path).read_text().split("\n") if line]


@pytest.fixture(scope="module")
def solo(model_dirs):
    """prompt → the greedy text of that prompt decoded alone (raw, 12 tokens)."""
    decoder = SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False,
                                 num_speculative_tokens=3)
    return {p: decoder.generate(p, max_new_tokens=12, sampling=SamplingParams(temperature=0), chat=False).text
            for p in PROMPTS}


def test_one_output_line_per_input_line_bad_lines_as_errors(model_dirs, solo, tmp_path, capsys):
    rows = [{"id": "a", "prompt": "abc"}, {"prompt": "hhh a", "max_tokens": 5},
            "not json {", {"id": "t", "prompt": "ace", "temperature": -1},
            {"id": "m", "messages": [{"role": "user", "content": "abc"}]},  # no chat template here
            {"id": 9, "prompt": "the cafe", "task_id": "kept out"}, "", {"prompt": ""}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out.jsonl")
    assert main(["batch", inp, "--output", out, *models(model_dirs), "--temperature", "0", "--max-tokens", "12",
                 "--raw", "--max-batch-size", "2"]) == 0
    records = {json.dumps(r["id"]): r for r in read_jsonl(out)}
    assert sorted(records) == sorted(['"a"', "2", "3", '"t"', '"m"', "9", "8"])
    assert records['"a"']["text"] == solo["abc"] and records["9"]["text"] == solo["the cafe"]
    assert records["2"]["usage"]["completion_tokens"] == 5 and records["2"]["finish_reason"] == "length"
    assert solo["hhh a"].startswith(records["2"]["text"])
    assert records['"a"']["speculation"]["num_drafted"] > 0
    assert records['"a"']["usage"]["prompt_tokens"] == 3
    assert "not JSON" in records["3"]["error"] and "temperature" in records['"t"']["error"]
    assert "chat template" in records['"m"']["error"] and "prompt" in records["8"]["error"]
    err = capsys.readouterr().err
    assert "3 rows done, 4 failed, 0 already in the output" in err and "tokens/s" in err
    assert "rows 7/7 [" in err and "ETA" in err and "4 failed" in err  # the progress bar (one line per tenth here)
    # a rerun finds everything done and writes nothing
    assert main(["batch", inp, "--output", out, *models(model_dirs), "--temperature", "0", "--quiet"]) == 0
    assert len(read_jsonl(out)) == 7


def test_simple_lines_take_n_echo_logit_bias_min_tokens_and_ignore_eos(model_dirs, solo, tmp_path):
    rows = [{"id": "n", "prompt": "abc", "n": 3, "temperature": 1.0, "seed": 5},
            {"id": "n1", "prompt": "abc", "temperature": 1.0, "seed": 6},
            {"id": "echo", "prompt": "bad bed", "echo": True, "logprobs": 1, "max_tokens": 0},
            {"id": "bias", "prompt": "abc", "logit_bias": {"1": 40}, "min_tokens": 3},   # 1: <eos>
            {"id": "ignore", "prompt": "abc", "logit_bias": {"1": 40}, "ignore_eos": True, "max_tokens": 5}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out.jsonl")
    assert main(["batch", inp, "--output", out, *models(model_dirs), "--temperature", "0", "--max-tokens", "12",
                 "--raw", "--quiet"]) == 0
    records = {r["id"]: r for r in read_jsonl(out)}
    choices = records["n"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and choices[1]["text"] == records["n1"]["text"]
    assert 3 <= records["n"]["usage"]["completion_tokens"] <= 36 and "text" not in records["n"]
    echo = records["echo"]
    assert echo["text"] == "bad bed" and echo["usage"]["completion_tokens"] == 0
    assert echo["logprobs"]["token_logprobs"][0] is None and len(echo["logprobs"]["tokens"]) == 7
    assert all(v < 0 for v in echo["logprobs"]["token_logprobs"][1:])
    assert records["bias"]["usage"]["completion_tokens"] == 4 and records["bias"]["finish_reason"] == "eos"
    assert records["ignore"]["usage"]["completion_tokens"] == 5 and records["ignore"]["finish_reason"] == "length"


def test_a_half_written_last_line_is_cut_and_its_row_done_again(model_dirs, solo, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": p, "prompt": p} for p in PROMPTS[:4]])
    out = tmp_path / "out.jsonl"
    flags = [*models(model_dirs), "--temperature", "0", "--max-tokens", "12", "--raw"]
    assert main(["batch", inp, "--output", str(out), *flags]) == 0
    whole = out.read_text().splitlines(keepends=True)
    out.write_text("".join(whole[:2]) + whole[2][:len(whole[2]) // 2])  # a crash mid-write
    assert main(["batch", inp, "--output", str(out), *flags]) == 0
    assert "half-written line" in capsys.readouterr().err
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(PROMPTS[:4])
    assert all(r["text"] == solo[r["id"]] for r in records)


def test_duplicate_ids_and_a_foreign_output_file_exit_2_before_anything(model_dirs, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "abc"}, {"prompt": "ace"}])  # line 2 is id 2
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": 2, "prompt": "abc"}, {"prompt": "ace"}])
    out = tmp_path / "out.jsonl"
    assert main(["batch", dup, "--output", str(out), *models(model_dirs)]) == 2
    err = capsys.readouterr().err
    assert "also on line 1" in err and not out.exists()  # no output file left behind
    assert "loading" not in err  # refused before any model loads
    out.write_text("hello\n")
    assert main(["batch", inp, "--output", str(out), *models(model_dirs), "--quiet"]) == 2
    assert "not a batch output line" in capsys.readouterr().err and out.read_text() == "hello\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["batch", inp, "--output", str(out), "--workers", "2"])
    assert exit_info.value.code == 2 and "--workers and --cpus-per-worker need --ray" in capsys.readouterr().err


def test_lines_are_checked_like_server_bodies_before_any_model_loads(model_dirs, tmp_path, capsys):
    rows = [{"id": "w", "messages": [{"role": "wizard", "content": "abc"}]},  # a role the server refuses
            {"id": [1], "prompt": "abc"}, {"id": None, "prompt": "abc"},      # ids that are not ids
            {"id": "k", "prompt": "abc", "top_k": "3"}, {"id": "ok", "prompt": "abc", "max_tokens": 4}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["batch", inp, "--output", str(out), *models(model_dirs), "--raw", "--quiet"]) == 0
    records = read_jsonl(out)
    errors = {json.dumps(r["id"]): r["error"] for r in records if "error" in r}
    assert "messages.0.role" in errors['"w"'] and "top_k" in errors['"k"']
    assert "id must be a string or an integer" in errors["2"] and "id must be" in errors["3"]
    assert [r["id"] for r in records if "text" in r] == ["ok"]
    # an OpenAI-format line that cannot be matched to its output stops the job before it starts
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"custom_id": "a", "url": "/v1/completions", "body": {}},
                                               {"url": "/v1/completions", "body": {}}])
    assert main(["batch", bad, "--output", str(tmp_path / "o2.jsonl"), *models(model_dirs)]) == 2
    err = capsys.readouterr().err
    assert 'line 2: an OpenAI batch line needs a string "custom_id"' in err and "loading" not in err
    assert not (tmp_path / "o2.jsonl").exists()


@pytest.fixture(scope="module")
def uninterrupted(model_dirs, tmp_path_factory):
    """The signal and kill tests' input, 240 rows, and id → text of an uninterrupted run of it: long
    enough that a job cannot finish between the line a test waits for and its signal (24 rows of
    the tiny pair took 0.4 s)."""
    root = tmp_path_factory.mktemp("signal")
    rows = [{"id": f"s{i}", "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))} for i in range(240)]
    inp, out = write_jsonl(root / "in.jsonl", rows), str(root / "reference.jsonl")
    assert main(["batch", inp, "--output", out, *long_job(model_dirs)]) == 0
    return inp, {r["id"]: r["text"] for r in read_jsonl(out)}


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow
def test_ctrl_c_or_sigterm_stops_the_job_with_a_summary_keeping_whole_lines(model_dirs, uninterrupted, tmp_path,
                                                                            signum, status):
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    command, env = subprocess_job(model_dirs, inp, str(out))
    command.remove("--quiet")
    # as from a terminal: SIGINT at its default in the job (an earlier test in this process may leave
    # it ignored, and an ignored SIGINT is inherited: Python then installs no KeyboardInterrupt)
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
        time.sleep(0.01)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=10)  # within a few seconds
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job did not stop within 10 s of the signal")
    assert proc.returncode == status, err
    assert "interrupted;" in err and "rows done" in err and "run the same command again" in err
    records = read_jsonl(out)  # whole lines only, each the uninterrupted text
    assert 2 <= len(records) < len(expected) and all(expected[r["id"]] == r["text"] for r in records)


def test_journal_keeps_whole_lines_and_cuts_only_a_half_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 1, "text": "x"}\n{"id": "1", "text": "y"}\n{"id": 3, "te')
    with OutputJournal(str(path)) as journal:
        assert journal.done == {"1", '"1"'} and journal.cut_bytes == len('{"id": 3, "te')
        journal.append({"id": 3, "text": "z\u2028"})
    assert read_jsonl(path)[-1] == {"id": 3, "text": "z\u2028"}
    assert OutputJournal(str(path)).done == {"1", '"1"', "3"}


def long_job(dirs):
    """Flags of a job of greedy 40-token rows, two at a time."""
    return [*models(dirs), "--raw", "--temperature", "0", "--max-tokens", "40", "--max-batch-size", "2", "--quiet"]


def subprocess_job(dirs, inp, out):
    """`python -m specdecode.cli batch ...` from this checkout, and its environment."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return [sys.executable, "-m", "specdecode.cli", "batch", inp, "--output", out, *long_job(dirs)], env


# The goal: no row lost or duplicated in 3 runs out of 3, killed early, midway and late.
@pytest.mark.parametrize("kill_after", [1, 120, 200])
@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_every_id_once_and_the_uninterrupted_texts(model_dirs, uninterrupted,
                                                                                    tmp_path, kill_after):
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    command, env = subprocess_job(model_dirs, inp, str(out))
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= kill_after:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the job ended before it was killed: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_text().count("\n")
    assert kill_after <= written < len(expected)
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    records = read_jsonl(out)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(expected) and len(set(ids)) == len(ids) == len(expected) == 240
    assert {r["id"]: r["text"] for r in records} == expected


def _scale_out_commands() -> list[list[str]]:
    """The `specdecode ...` command lines of docs/batch-and-scale-out.md's "Commands" section."""
    import re
    import shlex

    page = (ROOT / "docs" / "batch-and-scale-out.md").read_text(encoding="utf-8")
    text = page.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith("specdecode ")]


def test_the_scale_out_docs_commands_parse_and_the_local_batch_runs_as_written(model_dirs, tmp_path,
                                                                                   monkeypatch, capsys):
    from specdecode.cli import build_parser

    commands = _scale_out_commands()
    assert [argv[1] for argv in commands] == ["batch", "batch", "serve"]
    for argv in commands:
        build_parser().parse_args(argv[1:])  # every flag exists (a bad one exits 2)
    monkeypatch.chdir(ROOT)
    argv = commands[0]
    out = tmp_path / "answers.jsonl"
    argv[argv.index("--output") + 1] = str(out)
    argv[argv.index("--max-tokens") + 1] = "6"
    assert main([*argv[1:], *models(model_dirs), "--quiet"]) == 0
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "examples/prompts.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in read_jsonl(out)) == list(range(1, len(prompts) + 1))


def test_summary_counts_openai_format_records_by_their_status():
    """OpenAI's batch format carries "error": null on every line; the status code says what failed."""
    from specdecode.scale.batch import BatchSummary

    ok = {"id": "batch_req_1", "custom_id": "a", "error": None,
          "response": {"status_code": 200, "request_id": "r1",
                       "body": {"usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11},
                                "speculation": {"num_drafted": 10, "num_accepted": 6}}}}
    missing = {"id": "batch_req_2", "custom_id": "b", "error": None,
               "response": {"status_code": 404, "request_id": "r2",
                            "body": {"error": {"message": "no such model", "type": "invalid_request_error"}}}}
    simple_error = {"id": "c", "error": "prompt is empty"}
    summary = BatchSummary(rows=4)
    for record in (ok, ok, missing, simple_error):
        summary.add(record)
    assert (summary.done, summary.failed, summary.tokens) == (2, 2, 14)
    assert (summary.drafted, summary.accepted) == (20, 12)


def test_progress_eta_comes_from_decoded_rows_not_from_instant_errors():
    import io

    from specdecode.cli.batch import ProgressBar
    from specdecode.scale.batch import BatchSummary

    out = io.StringIO()
    bar = ProgressBar(out)
    summary = BatchSummary(rows=3, failed=1, wall_time_s=0.01)  # a refused row, written at once
    bar(summary, 3)
    assert "ETA ?" in out.getvalue()
    summary.done, summary.wall_time_s = 1, 10.0
    bar(summary, 3)
    assert out.getvalue().splitlines()[-1].endswith("ETA 10s, 1 failed")
