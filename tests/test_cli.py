"""The `specdecode` command on tiny local models: Ctrl-C, the summary line, usage errors, where alpha
and bench write, and the command-line examples of README.md and docs/cli.md."""

import io
import itertools
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdecode.cli import main
from specdecode.cli.generate import summary

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOCS = ROOT / "docs" / "cli.md"


# A shell started in the background ignores SIGINT, and its children inherit that; the launcher
# restores the default before exec so that Python installs its Ctrl-C handler (no preexec_fn: this
# process has torch's threads).
LAUNCHER = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"


def _start(args: list[str]) -> subprocess.Popen:
    """`python -m specdecode.cli ARGS` from this checkout, with Ctrl-C (SIGINT) enabled."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "specdecode.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _read_until(pipe, enough, timeout_s: float) -> bytes:
    """Reads `pipe` until enough(data) is true; fails after timeout_s or at end of file."""
    data, deadline = b"", time.monotonic() + timeout_s
    while not enough(data):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no output after {timeout_s} s; got {data!r}")
        if select.select([pipe], [], [], left)[0]:
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                pytest.fail(f"the command ended before it was interrupted; got {data!r}")
            data += chunk
    return data


def _interrupt(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """Sends Ctrl-C's SIGINT and returns the rest of stdout and stderr (the command must end within 60 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generate_forever(dirs, *extra) -> list[str]:
    return ["generate", "abc", "--target", dirs["target"], "--draft", dirs["draft"], "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "100000", *extra]


@pytest.mark.slow
def test_ctrl_c_keeps_the_streamed_text_ends_the_line_and_exits_130(long_model_dirs):
    proc = _start(_generate_forever(long_model_dirs, "--quiet"))
    try:
        streamed = _read_until(proc.stdout, lambda data: len(data) >= 8, timeout_s=180)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    rest, err = _interrupt(proc)
    out = (streamed + rest).decode()
    assert proc.returncode == 130, err.decode()
    assert out.endswith("\n") and out.count("\n") == 1 and len(out) > 8  # the text so far, one finished line
    assert "Traceback" not in err.decode()
    assert err.decode().splitlines() == ["specdecode: interrupted"]


@pytest.mark.slow
def test_ctrl_c_with_json_prints_nothing_on_stdout_and_one_line_on_stderr(long_model_dirs):
    proc = _start(_generate_forever(long_model_dirs, "--json", "--no-guard"))
    try:
        # The first progress line comes from inside main(); give it time to reach the decode loop.
        _read_until(proc.stderr, lambda data: b"\n" in data, timeout_s=180)
        time.sleep(5)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    out, err = _interrupt(proc)
    assert proc.returncode == 130, err.decode()
    assert out == b""
    assert "Traceback" not in err.decode()
    assert err.decode().splitlines()[-1] == "specdecode: interrupted"


def _result(num_generated: int, num_drafted: int = 0):
    stats = SimpleNamespace(num_generated=num_generated, wall_time_s=0.5, tokens_per_second=2.0,
                            num_target_calls=1, mean_tokens_per_call=1.0, num_drafted=num_drafted,
                            num_accepted=num_drafted, acceptance_rate=1.0)
    return SimpleNamespace(stats=stats, finish_reason="length")


@pytest.mark.parametrize("count,words", [(0, "0 tokens in"), (1, "1 token in"), (2, "2 tokens in"),
                                         (11, "11 tokens in")])
def test_summary_counts_tokens_in_the_right_number(count, words):
    assert summary(_result(count)).startswith(words + " 0.50 s (2.00 tokens/s)")


def test_summary_of_a_one_token_run_says_1_token(model_dirs, capsys):
    assert main(["generate", "abc", "--target", model_dirs["target"], "--draft", "none", "--dtype", "float32",
                 "--max-new-tokens", "1", "--no-guard"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("1 token in ")


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["generate", "@/no/such/file.txt"], "cannot read the prompt: [Errno 2] No such file or directory"),
    (["alpha", "--prompts", "0"], "--prompts and --max-new-tokens must be >= 1"),
    (["bench", "--new-tokens", "1"], "--new-tokens >= 2"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be in [1e-20, 1e20] (1 = off), got 0.0"),
    (["generate", "hi", "--presence-penalty", "2.5"], "--presence-penalty must be in [-2, 2] (0 = off), got 2.5"),
    (["generate", "hi", "--frequency-penalty", "-3"], "--frequency-penalty must be in [-2, 2] (0 = off), got -3.0"),
    (["generate", "hi", "--logprobs", "21", "--json"], "--logprobs must be None or an integer in [0, 20] (alternatives per token), got 21"),
    (["generate", "hi", "--logprobs", "2"], "--logprobs is printed in the --json output: add --json"),
    (["generate", "hi", "--json-schema", "/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json"),
    (["generate", "hi", "--grammar", "/no/such/g.ebnf"], "--grammar: cannot read /no/such/g.ebnf"),
    (["generate", "hi", "--logit-bias", "5:1"], "--logit-bias takes ID=BIAS"),
    (["generate", "hi", "--logit-bias", "5=200"], "--logit-bias values must be numbers in [-100, 100]"),
    (["generate", "hi", "--min-tokens", "9", "--max-new-tokens", "8"], "--min-tokens (9) must be at most"),
    # no abbreviations (--gamma is not --gamma-schedule), and the command's own parser names it
    (["generate", "hi", "--gamma", "0"], "specdecode generate: error: unrecognized arguments: --gamma 0"),
    (["generate", "--bogus", "hi"], "specdecode generate: error: unrecognized arguments: --bogus"),
    (["generate", "hi", "--batch-invariant", "on", "--dtype", "float32"], "--batch-invariant on runs the target"),
])
def test_bad_flags_exit_2_with_one_error_line(args, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(args)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def test_an_unknown_model_exits_2_with_one_line(capsys):
    assert main(["generate", "hi", "--target", "./no/such/dir", "--draft", "none"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("specdecode generate: error: ") and "./no/such/dir" in err[0]


def test_a_missing_draft_tokenizer_exits_2_with_one_line(capsys):
    assert main(["generate", "hi", "--draft-tokenizer", "./no/such/tok", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["specdecode generate: error: tokenizer path './no/such/tok' is not a directory"]


def test_the_default_out_is_a_new_dated_folder_of_its_own():
    from datetime import datetime

    from specdecode.cli.common import default_out

    assert default_out("alpha", datetime(2025, 1, 2, 3, 4, 5)) == Path("specdecode-runs/alpha-20250102-030405/alpha")


def test_an_existing_default_folder_is_refused_but_an_explicit_out_is_kept(tmp_path, monkeypatch):
    from datetime import datetime

    from specdecode.cli.common import out_path

    monkeypatch.chdir(tmp_path)
    now = datetime(2025, 1, 2, 3, 4, 5)
    assert out_path(None, "bench", now) == str(Path("specdecode-runs/bench-20250102-030405/bench"))
    assert not (tmp_path / "specdecode-runs").exists()  # picking a path writes nothing
    (tmp_path / "specdecode-runs" / "bench-20250102-030405").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="bench-20250102-030405 already exists; pass --out PATH"):
        out_path(None, "bench", now)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench.md").write_text("old")
    assert out_path("docs/bench", "bench", now) == "docs/bench"  # named by the user: theirs to overwrite


@pytest.fixture
def fake_reports(monkeypatch):
    """alpha_report and bench_report replaced by fakes that record `out` and write OUT.md; no model loads."""
    import specdecode.measure.alpha
    import specdecode.measure.bench

    outs = []

    def fake_report(decoder, *args, out, **kwargs):
        outs.append(out)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".md").write_text("# the report\n")

    monkeypatch.setattr(specdecode.measure.alpha, "alpha_report", fake_report)
    monkeypatch.setattr(specdecode.measure.bench, "bench_report", fake_report)
    monkeypatch.setattr(specdecode.measure.bench, "check_benchable", lambda decoder: None)
    for command in ("alpha", "bench"):
        monkeypatch.setattr(f"specdecode.cli.{command}.build_decoder", lambda args, progress: SimpleNamespace(draft=None))
    return outs


@pytest.mark.parametrize("command", ["alpha", "bench"])
def test_alpha_and_bench_write_into_a_new_folder_by_default(command, fake_reports, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, "--tasks", "translation"]) == 0
    [out] = fake_reports
    assert Path(out).parent.parent == Path("specdecode-runs") and Path(out).name == command
    assert Path(out).parent.name.startswith(f"{command}-")
    captured = capsys.readouterr()
    assert "# the report" in captured.out and f"wrote {out}.json, {out}.md" in captured.err


def test_bench_runs_the_target_on_torch_whatever_auto_would_choose(fake_reports, tmp_path, monkeypatch):
    # it compares with transformers on the same model; dtype="auto" may pick llama.cpp for generate
    seen = []
    monkeypatch.setattr("specdecode.cli.bench.build_decoder",
                        lambda config, progress: seen.append(config) or SimpleNamespace(draft=None))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--tasks", "translation"]) == 0
    assert seen[0].backend == "torch" and seen[0].dtype == "auto"


@pytest.mark.parametrize("command", ["alpha", "bench"])
def test_alpha_and_bench_refuse_an_existing_default_folder(command, fake_reports, tmp_path, monkeypatch, capsys):
    import specdecode.cli.common

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(specdecode.cli.common, "default_out", lambda command, now=None: Path("runs/same") / command)
    (tmp_path / "runs" / "same").mkdir(parents=True)
    with pytest.raises(SystemExit, match="^2$"):
        main([command, "--tasks", "translation"])
    assert "runs/same already exists; pass --out PATH" in capsys.readouterr().err.splitlines()[-1]
    assert fake_reports == []


def _doc_command_lines(page: Path = README, section: str = "") -> list[str]:
    """The lines of a Markdown page's bash blocks that run specdecode (continuations joined), within
    the `## section` if given."""
    text = page.read_text(encoding="utf-8")
    if section:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if "specdecode " in line]


def test_every_prompt_file_the_docs_name_exists():
    paths = []
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for line in [line for page in pages for line in _doc_command_lines(page)]:
        words = shlex.split(line, comments=True)
        paths += [word[1:] for word in words if word.startswith("@")]
        paths += [after for word, after in itertools.pairwise(words) if word == "--prompts-file"]
    assert len(paths) >= 3, paths
    assert [path for path in paths if not (ROOT / path).is_file()] == []


def test_the_cli_docs_generate_examples_run_as_written_from_the_repo_root(long_model_dirs, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    models = ["--target", long_model_dirs["target"], "--draft", long_model_dirs["draft"], "--dtype", "float32"]
    ran = []
    for line in _doc_command_lines(CLI_DOCS, "Examples"):
        piped, _, command = line.rpartition(" | ")
        argv = shlex.split(command, comments=True)
        if argv[:2] != ["specdecode", "generate"] or "--help" in argv:
            continue
        if piped:  # echo TEXT | specdecode generate -
            echo = shlex.split(piped)
            assert echo[0] == "echo", line
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((" ".join(echo[1:]) + "\n").encode())))
        # The example's own flags come after ours, so its --draft none wins; only the length is cut.
        assert main(["generate", *models, *argv[2:], "--max-new-tokens", "4", "--quiet"]) == 0, line
        out = capsys.readouterr().out
        if "--json" in argv:
            records = [json.loads(record) for record in out.splitlines()]
            assert len(records) == (4 if "--prompts-file" in argv else 1), line
        ran.append(line)
    assert len(ran) == 6, ran


def test_generate_json_with_logprobs_penalties_and_a_grammar(model_dirs, tmp_path, capsys):
    grammar = tmp_path / "g.txt"
    grammar.write_text("regex:(ab|cd)+[.]")
    base = ["generate", "abc", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "12", "--quiet", "--json", "--raw"]
    assert main(base + ["--logprobs", "2", "--repetition-penalty", "1.3", "--grammar", str(grammar)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["logprobs"]) == len(record["token_ids"]) and len(record["logprobs"][0]["top"]) == 2
    import re
    assert re.fullmatch("(ab|cd)*a?c?([.])?", record["text"])
    plain = ["generate", "abc", "--target", model_dirs["target"], "--draft", "none", "--dtype", "float32",
             "--temperature", "0", "--max-new-tokens", "12", "--quiet", "--json", "--raw"]
    assert main(plain + ["--repetition-penalty", "1.3", "--grammar", str(grammar)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == record["token_ids"]


def test_generate_min_tokens_ignore_eos_and_logit_bias(model_dirs, capsys):
    base = ["generate", "abc", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "10", "--quiet", "--json", "--raw", "--logit-bias", "1=40"]
    records = []
    for extra in ([], ["--min-tokens", "4"], ["--ignore-eos"]):  # 1 is <eos>: first, unless held back
        assert main(base + extra) == 0
        records.append(json.loads(capsys.readouterr().out))
    assert [len(r["token_ids"]) for r in records] == [1, 5, 10]
    assert [r["finish_reason"] for r in records] == ["eos", "eos", "length"]


def test_an_invalid_schema_or_grammar_exits_2_with_the_engines_message(model_dirs, tmp_path, capsys):
    schema, grammar = tmp_path / "s.json", tmp_path / "g.ebnf"
    schema.write_text('{"type": "nope"}')
    grammar.write_text("root ::= (")
    base = ["generate", "abc", "--target", model_dirs["target"], "--draft", "none", "--dtype", "float32", "--quiet"]
    assert main(base + ["--json-schema", str(schema)]) == 2
    assert capsys.readouterr().err.strip() == 'specdecode generate: error: invalid JSON schema: Unsupported type "nope"'
    assert main(base + ["--grammar", str(grammar)]) == 2
    assert capsys.readouterr().err.strip().startswith("specdecode generate: error: invalid grammar: EBNF parser error")
    schema.write_text("{not json")
    with pytest.raises(SystemExit, match="^2$"):
        main(base + ["--json-schema", str(schema)])
    assert "is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--temperature", "abc"], "--temperature"),
    (["generate", "x", "--dtype", "bf16"], "--dtype"),
    (["generate", "x", "--logprobs", "30", "--json"], "--logprobs"),
    (["batch", "in.jsonl", "--output", "out.jsonl", "--seed", str(2**64)], "--seed"),
])
def test_a_usage_error_is_one_line_naming_the_command_and_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specdecode {argv[0]}: error: ") and flag in err[0], err


def test_version(capsys):
    from specdecode import __version__

    with pytest.raises(SystemExit, match="^0$"):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"specdecode {__version__}"


@pytest.fixture(scope="module")
def chat_model_dirs(model_dirs, tmp_path_factory):
    """The tiny target with a chat template (each message's text, then a space)."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(model_dirs["target"], root / "target")
    config_path = root / "target" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config_path.write_text(json.dumps(config))
    return {"target": str(root / "target"), "plain": model_dirs["target"], "draft": model_dirs["draft"]}


def test_chat_streams_a_reply_per_message_keeps_the_conversation_and_resets(chat_model_dirs, monkeypatch, capsys):
    import io

    from specdecode import SpeculativeDecoder, SamplingParams

    lines = "abc\n\n/reset\nabc\nhead\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    argv = ["chat", "--target", chat_model_dirs["target"], "--draft", chat_model_dirs["draft"], "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "6"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    replies = out.splitlines()
    assert len(replies) == 3 and replies[0] == replies[1]  # /reset: the same first message, the same reply
    assert err.count("tokens/s") == 3 and "(conversation cleared)" in err
    # the third reply saw the whole conversation: what generate gives for the template of all of it
    decoder = SpeculativeDecoder(chat_model_dirs["target"], chat_model_dirs["draft"], dtype="float32")
    ids = decoder.requests.chat_ids([{"role": "user", "content": "abc"}, {"role": "assistant", "content": replies[1]},
                                     {"role": "user", "content": "head"}])
    expected = decoder.generate(ids, max_new_tokens=6, sampling=SamplingParams(temperature=0))
    assert replies[2] == expected.text


def test_chat_without_a_chat_template_exits_2_with_one_line(chat_model_dirs, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--target", chat_model_dirs["plain"], "--draft", "none", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "chat template" in err[-1]


def test_more_threads_than_cpus_run_as_many_as_there_are(capsys):
    import argparse
    import os

    import torch

    from specdecode.cli.common import add_model_flags, decoder_config

    parser = argparse.ArgumentParser(prog="specdecode generate")
    add_model_flags(parser)
    before = torch.get_num_threads()
    try:
        decoder_config(parser.parse_args(["--threads", "999"]), parser)
        cpus = len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == cpus
        assert f"--threads 999 is more than the {cpus} CPUs this process may use: running {cpus}" in \
            capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_a_bad_value_found_after_parsing_is_answered_without_loading_torch():
    # SamplingParams and RequestOptions check without torch: one line in ~0.1 s, not ~1 s
    code = ("import sys\nfrom specdecode.cli import main\n"
            "try:\n    main(['generate', 'x', '--min-tokens', '9', '--max-new-tokens', '8'])\n"
            "except SystemExit as exit_:\n    print('exit', exit_.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "exit 2 False", done.stdout + done.stderr
    assert "--min-tokens (9) must be at most --max-new-tokens (8)" in done.stderr
