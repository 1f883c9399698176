"""`specdecode chat`: an interactive conversation in the terminal, each reply streamed as it is
accepted, coloured by where each token came from (as the live page colours them)."""

from __future__ import annotations

import sys

from specdecode.cli.common import add_model_flags, build_decoder, decoder_config, error, stderr_progress
from specdecode.cli.generate import COLOURS, RESET, summary

COMMANDS_HELP = "/reset clears the conversation, /exit (or Ctrl-D) leaves"


def add_parser(sub) -> None:
    chat = sub.add_parser(
        "chat", help="chat with the target model interactively",
        description="An interactive conversation through the target's chat template: type a message, the reply "
                    f"streams as it is accepted. {COMMANDS_HELP}; Ctrl-C stops a reply. On a terminal each "
                    "token is coloured by origin (green = accepted draft, blue = target correction, yellow = "
                    "bonus token) unless --no-color; a one-line summary per reply goes to stderr.")
    add_model_flags(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message that starts the conversation")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (default: 0.7)")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    chat.add_argument("--seed", type=int, default=None, help="random seed of every reply (the same conversation "
                                                            "then gives the same replies)")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="most new tokens per reply (default: 512)")
    chat.add_argument("--no-color", action="store_true", help="plain text even on a terminal")


def run(args, parser) -> int:
    from specdecode.sampling_params import SamplingParams

    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    config = decoder_config(args, parser)
    try:
        decoder = build_decoder(config, stderr_progress(args))
        start = [{"role": "system", "content": args.system}] if args.system else []
        decoder.requests.chat_ids(start + [{"role": "user", "content": "hi"}])  # no template: say so now
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    colour = sys.stdout.isatty() and not args.no_color
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"specdecode chat ({COMMANDS_HELP})", file=sys.stderr)
    messages = list(start)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as in a shell
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        reply = _reply(decoder, messages + [{"role": "user", "content": line}], args, sampling, colour)
        if reply is not None:
            messages += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
    return 0


def _reply(decoder, messages: list[dict], args, sampling, colour: bool) -> str | None:
    """Streams the reply to messages; returns its text, or None where it did not happen (a
    conversation past the context window; Ctrl-C), which leaves the conversation as it was."""
    try:
        ids = decoder.requests.chat_ids(messages)
        stream = decoder.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, stream=True)
        for event in stream:
            if event.text:
                sys.stdout.write(COLOURS[event.origin] + event.text + RESET if colour and event.origin in COLOURS
                                 else event.text)
                sys.stdout.flush()
    except ValueError as err:  # e.g. the conversation no longer fits the context window
        print(f"specdecode chat: error: {err}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        sys.stdout.write((RESET if colour else "") + "\n")
        print("(reply stopped)", file=sys.stderr)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(summary(stream.result), file=sys.stderr)
    return stream.result.text
