"""Usage errors of the scale-out flags: one line, exit 2, before Ray or a model starts."""

import pytest

from specdecode.cli import main


@pytest.mark.parametrize("argv, message", [
    (["serve", "--ray", "auto"], "--ray needs --replicas N"),
    (["serve", "--autoscale", "1:2"], "--autoscale needs --replicas N"),
    (["serve", "--replicas", "0"], "--replicas must be >= 1"),
    (["serve", "--replicas", "2", "--autoscale", "3:1"], "0 <= MIN <= MAX"),
    (["serve", "--replicas", "2", "--autoscale", "two"], "two integers"),
    (["serve", "--replicas", "2", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0"),
    (["batch", "in.jsonl", "--output", "o.jsonl", "--workers", "0"], "--workers must be >= 1"),
    (["batch", "in.jsonl", "--output", "o.jsonl", "--rows-per-task", "0", "--ray"], "--rows-per-task must be >= 1"),
    (["batch", "in.jsonl", "--output", "o.jsonl", "--top-p", "0"], "--top-p must be in (0, 1]"),
    # the rows are read with the server's schema, and so are the defaults these flags give them
    (["batch", "in.jsonl", "--output", "o.jsonl", "--temperature", "2.5"], "--temperature: Input should be less"),
    (["batch", "in.jsonl"], "--output"),
])
def test_bad_scale_out_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("error:") == 1


@pytest.mark.parametrize("command", [["serve", "--replicas", "2"], ["batch", "IN", "--output", "OUT", "--ray"]])
def test_a_model_that_cannot_load_fails_before_ray_starts(command, tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    (tmp_path / "in.jsonl").write_text('{"prompt": "abc"}\n')
    argv = [str(tmp_path / "in.jsonl") if a == "IN" else str(tmp_path / "out.jsonl") if a == "OUT" else a
            for a in command]
    assert main([*argv, "--target", str(tmp_path / "missing"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err and not ray.is_initialized()
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""


@pytest.mark.parametrize("command", [["serve", "--replicas", "1", "--ray", "ADDRESS"],
                                     ["batch", "IN", "--output", "OUT", "--ray", "ADDRESS"]])
def test_a_ray_address_with_nothing_listening_fails_at_once(command, model_dirs, tmp_path, capsys):
    # ray.init would retry such an address for minutes
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "in.jsonl").write_text('{"prompt": "abc"}\n')
    argv = [{"IN": str(tmp_path / "in.jsonl"), "OUT": str(tmp_path / "out.jsonl"), "ADDRESS": address}.get(a, a)
            for a in command]
    start = time.monotonic()
    assert main([*argv, "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "float32",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"no Ray cluster at {address}" in err and err.count("\n") == 1 and time.monotonic() - start < 60
    assert not ray.is_initialized()
