"""`specdecode serve`: the OpenAI-compatible server (specdecode.serve) on uvicorn."""

from __future__ import annotations

import argparse
import signal
import sys

from specdecode.cli.common import add_model_flags, build_decoder, check_model_flags, error, stderr_progress


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching, SSE streaming, metrics, live page)",
        description="Serve the target (speculating with the draft) over the OpenAI wire format: GET /v1/models, "
                    "POST /v1/completions, POST /v1/chat/completions (SSE with stream=true), GET /metrics "
                    "(Prometheus), GET /health, and a live page at GET / that colours each token by origin. "
                    "Concurrent requests join the running batch at the next step.")
    add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--max-batch-size", type=int, default=8,
                       help="the most requests decoded together; the others wait (default: 8)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests that may wait for a free row; more get HTTP 429 (default: 64)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the --target value)")


def run(args, parser: argparse.ArgumentParser) -> int:
    check_model_flags(args, parser)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch_size < 1 or args.max_queue < 0:
        parser.error("--max-batch-size must be >= 1 and --max-queue >= 0")
    try:
        import uvicorn

        from specdecode.serve.app import create_app
    except ImportError as err:
        parser.error(f"serve needs the [serve] extra: pip install -e '.[serve]' ({err})")
    progress = stderr_progress(args)
    try:
        decoder = build_decoder(args, progress, max_batch_size=args.max_batch_size)
    except (ValueError, FileNotFoundError) as err:
        return error(err)
    name = args.served_model_name or args.target
    app = create_app(decoder, model_name=name, max_queue=args.max_queue, api_key=args.api_key)
    if progress:
        progress(f"serving {name!r} on http://{args.host}:{args.port} (page: /, API: /v1, metrics: /metrics)")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=10,
                                           log_level="warning" if args.quiet else "info"))
    # On SIGINT/SIGTERM, first end every in-flight request (streams get an error event and
    # [DONE], waiting clients a 503), so uvicorn's graceful shutdown finds no open request to cut.
    # uvicorn then re-raises the signal under the handler that was there before it: for SIGTERM
    # that is this no-op, so the process exits 0.
    uvicorn_exit = server.handle_exit

    def handle_exit(signum, frame):
        app.state.worker.shutdown()
        uvicorn_exit(signum, frame)

    server.handle_exit = handle_exit
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if progress:
        print("specdecode: server stopped", file=sys.stderr)
    return 0
