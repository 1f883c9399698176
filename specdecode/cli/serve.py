"""`specdecode serve`: the OpenAI-compatible server (specdecode.serve) on uvicorn."""

from __future__ import annotations

import argparse
import signal
import sys

from specdecode.cli.common import (add_model_flags, add_served_name_flag, build_decoder, decoder_config, error,
                                   served_name, stderr_progress)


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
    add_served_name_flag(serve)
    serve.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
                       help="Host names accepted besides the bound address and localhost (a DNS-rebinding guard); "
                            "needed when clients reach a --host 0.0.0.0 server by another name; '*' accepts any")
    serve.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN]",
                       help="web pages (e.g. https://app.example.com) whose scripts may call the server; by default "
                            "only its own page; '*' allows any")
    serve.add_argument("--timeout-request", type=float, default=30.0, metavar="SECONDS",
                       help="close a connection that takes longer than this to send a request (default: 30)")
    serve.add_argument("--max-connections", type=int, default=256,
                       help="concurrent connections and requests before new ones get 503 (default: 256)")
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="run the server as N Ray Serve replicas (one process and decoder each) behind Ray "
                            "Serve's HTTP proxy on --host/--port; Ray restarts a replica that dies. Needs the [ray] "
                            "extra (default: one process, no Ray)")
    serve.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="with --replicas: the Ray cluster to deploy on (e.g. auto or HOST:6379); default: start "
                            "a local one on this machine")
    serve.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="with --replicas: let Ray Serve's autoscaler keep between MIN and MAX replicas, aiming at "
                            "--max-batch-size requests in flight per replica (--replicas is the number it starts with)")
    serve.add_argument("--cpus-per-replica", type=float, default=None,
                       help="with --replicas: CPUs each replica reserves, and its torch threads (default: a local "
                            "cluster's CPUs / the most replicas, at least 1; 1 on a cluster given with --ray)")


def run(args, parser: argparse.ArgumentParser) -> int:
    config = decoder_config(args, parser, max_batch_size=args.max_batch_size)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch_size < 1 or args.max_queue < 0:
        parser.error("--max-batch-size must be >= 1 and --max-queue >= 0")
    if not args.timeout_request > 0 or args.max_connections < 1:
        parser.error("--timeout-request must be > 0 and --max-connections >= 1")
    try:
        import uvicorn

        from specdecode.serve.app import create_app
        from specdecode.serve.security import timed_protocol
    except ImportError as err:
        parser.error(f"serve needs the [serve] extra: pip install -e '.[serve]' ({err})")
    autoscale = _check_replica_flags(args, parser)
    if args.replicas is not None:
        return _run_replicas(args, parser, config, autoscale)
    progress = stderr_progress(args)
    try:
        decoder = build_decoder(config, progress)
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    name = served_name(args)
    app = create_app(decoder, model_name=name, **app_options(args))
    if progress:
        progress(f"serving {name!r} on http://{args.host}:{args.port} (page: /, API: /v1, metrics: /metrics)")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=10,
                                           log_level="warning" if args.quiet else "info",
                                           http=timed_protocol(args.timeout_request),
                                           limit_concurrency=args.max_connections))
    # On SIGINT/SIGTERM, first end every in-flight request (streams get an error event and
    # [DONE], waiting clients a 503), so uvicorn's graceful shutdown finds no open request to cut.
    # uvicorn then re-raises the signal under the handler that was there before it: these no-ops,
    # so the process ends through the return below.
    uvicorn_exit = server.handle_exit
    signals = []

    def handle_exit(signum, frame):
        signals.append(signum)
        app.state.worker.shutdown()
        uvicorn_exit(signum, frame)

    server.handle_exit = handle_exit
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # (uvicorn re-raises it when it ends)
    server.run()
    if progress:
        print("specdecode: server stopped", file=sys.stderr)
    # SIGTERM is how a service is stopped: 0; Ctrl-C exits 130, as every command does
    return 130 if signal.SIGINT in signals else 0


def app_options(args) -> dict:
    """create_app's options from the flags."""
    def listed(values):
        return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

    return dict(max_queue=args.max_queue, api_key=args.api_key, host=args.host, port=args.port,
                allowed_hosts=listed(args.allowed_hosts), allowed_origins=listed(args.allowed_origins))


def _check_replica_flags(args, parser) -> tuple[int, int] | None:
    """--replicas, --ray, --autoscale and --cpus-per-replica; returns --autoscale as (MIN, MAX)."""
    if args.replicas is None:
        for flag, value in (("--ray", args.ray), ("--autoscale", args.autoscale),
                            ("--cpus-per-replica", args.cpus_per_replica)):
            if value is not None:
                parser.error(f"{flag} needs --replicas N")
        return None
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.cpus_per_replica is not None and args.cpus_per_replica <= 0:
        parser.error(f"--cpus-per-replica must be > 0, got {args.cpus_per_replica}")
    if args.autoscale is None:
        return None
    low, _, high = args.autoscale.partition(":")
    try:
        low, high = int(low), int(high)
    except ValueError:
        parser.error(f"--autoscale takes MIN:MAX, two integers, got {args.autoscale!r}")
    if not 0 <= low <= high or high < 1:
        parser.error(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {args.autoscale!r}")
    return low, high


def _run_replicas(args, parser, config, autoscale) -> int:
    """The server as Ray Serve replicas; runs until SIGINT or SIGTERM, then removes them."""
    import os
    import threading

    try:
        from specdecode.scale import cluster, ray_serve
    except ImportError as err:
        parser.error(f"--replicas needs the [ray] extra: pip install -e '.[ray]' ({err})")
    most = autoscale[1] if autoscale else args.replicas
    cpus = args.cpus_per_replica or (max(1, (os.cpu_count() or 1) // most) if args.ray is None else 1)
    plan = ray_serve.Replicas(replicas=args.replicas, cpus=cpus, max_ongoing=args.max_batch_size + args.max_queue,
                              max_batch_size=args.max_batch_size, autoscale=autoscale)
    name = served_name(args)
    kwargs = config.plain()
    # A signal during the start is kept and acted on once the replicas are up (they are then
    # removed). Set again after ray.init, which installs its own crash handlers.
    stopping = threading.Event()

    signals = []

    def catch_signals():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, frame: (signals.append(signum), stopping.set()))

    catch_signals()
    started = False
    try:
        if args.ray is None:
            cluster.check_models(kwargs)
        # a local cluster gets room for every replica, whatever the machine's cores (Ray's CPUs
        # are reservations; the replicas' torch threads share the real cores)
        started = cluster.connect(args.ray, args.quiet, num_cpus=max(os.cpu_count() or 1, int(most * cpus + 0.999)))
        catch_signals()
        ray_serve.start(ray_serve.deployment(kwargs, name, app_options(args), plan), args.host, args.port)
    except (ConnectionError, RuntimeError, ValueError) as err:
        cluster.disconnect(started)
        return error(err)
    if not args.quiet:
        print(f"specdecode: serving {name!r} on http://{args.host}:{args.port} as {args.replicas} Ray Serve "
              f"replica(s){f' (autoscaling {autoscale[0]}..{autoscale[1]})' if autoscale else ''}; "
              "Ctrl-C stops them", file=sys.stderr, flush=True)
    while not stopping.wait(1):
        pass
    ray_serve.stop()
    cluster.disconnect(started)
    if not args.quiet:
        print("specdecode: replicas stopped", file=sys.stderr)
    return 130 if signal.SIGINT in signals else 0
