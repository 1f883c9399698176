"""Start-up progress on the "specdecode" logger (specdecode.progress)."""

import logging

from specdecode import progress


def test_the_default_shows_lines_on_stderr_only_until_the_application_sets_up_logging(monkeypatch, capsys):
    root, ours = logging.getLogger(), progress.logger
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    progress.default()("first")
    assert capsys.readouterr().err == "specdecode: first\n"
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    root.addHandler(handler)  # the application configures logging after its first decoder
    progress.default()("second")
    assert capsys.readouterr().err == "" and seen == ["second"]  # once, through its handler
