"""The `specdecode` command: parses, builds dataclasses, calls the library, prints.

One module per command (generate, chat, alpha, bench, serve, batch, tune), each with `add_parser(sub)` and `run(args, parser)`;
`common` holds the shared model and speed flags, prompt reading, progress and the decoder.
"""

from __future__ import annotations

import argparse
import os
import sys

from specdecode.cli import alpha, batch, bench, chat, common, generate, serve, tune

COMMANDS = {"generate": generate, "chat": chat, "alpha": alpha, "bench": bench, "serve": serve, "batch": batch, "tune": tune}


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `specdecode generate: error: --flag ...` and exit 2 (the
    full usage stays behind --help), and no abbreviated flags (`--gamma 0` would be taken as
    `--gamma-schedule 0`). Sub-command parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from specdecode import __version__

    parser = Parser(
        prog="specdecode",
        description="Exact speculative decoding (Leviathan et al., ICML 2023): a draft model proposes "
                    "tokens, the target verifies them in one call, and the output is distributed "
                    "exactly as sampling the target alone.")
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit status (2 for bad input, 130 after Ctrl-C)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # the command's own parser, so that its errors (an unknown flag too) name the command
    command_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)) \
        .choices[args.command]
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        common.COMMAND["name"] = args.command
        return COMMANDS[args.command].run(args, command_parser)
    except KeyboardInterrupt:  # Ctrl-C: whatever was printed stays, no traceback
        print("specdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `specdecode generate ... | head`: the reader left
        # Python flushes stdout at exit: point it at /dev/null so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
