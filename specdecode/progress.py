"""Start-up progress: one-line messages on the "specdecode" logger.

A first start assembles, builds and times for a minute or more: a silent one looks hung. The
library's default progress (`log`) logs at INFO on the "specdecode" logger and, where the
application has configured no logging of its own, shows it on stderr as "specdecode: ...". The
CLI shows the same lines the same way (`to_stderr`), or none with --quiet.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("specdecode")


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirect made later)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("specdecode: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def to_stderr(show: bool = True) -> None:
    """Show the "specdecode" logger's INFO lines on stderr as "specdecode: ..." (the handler added
    once); show=False shows only its warnings and errors (the CLI's --quiet)."""
    if not any(isinstance(handler, _Stderr) for handler in logger.handlers):
        logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO if show else logging.WARNING)


def log(message: str) -> None:
    """`message` at INFO on the "specdecode" logger."""
    logger.info(message)


def default():
    """The library's default progress, `log`, shown on stderr where the application has set up no
    logging of its own (neither a root handler nor one of this logger). Once the application has
    (after an earlier decoder), its handlers show the lines and this module's stderr line goes."""
    ours = [handler for handler in logger.handlers if getattr(handler, "by_default", False)]
    if logging.getLogger().handlers:
        for handler in ours:
            logger.removeHandler(handler)
    elif not logger.handlers:
        to_stderr()
        for handler in logger.handlers:
            handler.by_default = True
    return log
