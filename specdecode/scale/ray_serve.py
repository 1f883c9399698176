"""`specdecode serve --replicas N`: the server's FastAPI app (specdecode.serve.app) as N Ray Serve
replicas behind Ray Serve's HTTP proxy. Each replica is one process with its own decoder and engine
worker, exactly the single-process server; Ray Serve routes each request to a replica, restarts
replicas that die, and (with autoscaling) adds or removes them by the requests in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray import serve

from specdecode.scale.cluster import use_assigned_cpus

APP_NAME = "specdecode"


@serve.ingress()
class SpecdecodeReplica:
    """One replica: builds its SpeculativeDecoder from a DecoderConfig's fields, then the FastAPI app over it
    (Ray Serve runs the app's lifespan, which starts and stops the engine worker)."""

    def __init__(self, config: dict, model_name: str, app_options: dict):
        from specdecode import SpeculativeDecoder
        from specdecode.config import DecoderConfig

        use_assigned_cpus()
        self.decoder = SpeculativeDecoder.from_config(DecoderConfig(**config))
        self.model_name, self.app_options = model_name, app_options

    def __serve_build_asgi_app__(self):
        from specdecode.serve.app import create_app

        return create_app(self.decoder, model_name=self.model_name, **self.app_options)


@dataclass(frozen=True)
class Replicas:
    """How many replicas and what each reserves.

    replicas: the number (with autoscale: the number to start with).  autoscale: (min, max)
    replicas for Ray Serve's autoscaler, which aims at max_batch_size requests in flight per
    replica; None keeps `replicas` fixed.  cpus: CPUs each replica reserves (its torch threads).
    max_ongoing: requests Ray Serve sends one replica at once (its batch plus its queue; more
    wait in the proxy).
    """

    replicas: int
    cpus: float
    max_ongoing: int
    max_batch_size: int
    autoscale: tuple[int, int] | None = None


def deployment(config: dict, model_name: str, app_options: dict, plan: Replicas):
    """The bound Ray Serve application (pass to serve.run). app_options: create_app's keyword
    arguments (max_queue, api_key, host, port, allowed_hosts, allowed_origins)."""
    options = dict(ray_actor_options={"num_cpus": plan.cpus}, max_ongoing_requests=plan.max_ongoing,
                   health_check_period_s=2, graceful_shutdown_timeout_s=10)
    if plan.autoscale is None:
        options["num_replicas"] = plan.replicas
    else:
        low, high = plan.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "initial_replicas": min(max(plan.replicas, low), high),
                                         "target_ongoing_requests": plan.max_batch_size}
    return serve.deployment(SpecdecodeReplica, name="SpecdecodeReplica", **options).bind(
        config, model_name, app_options)


def start(app, host: str, port: int) -> None:
    """Starts Ray Serve's HTTP proxy on host:port and deploys `app` at /; returns when the
    replicas are up (raises RuntimeError if they fail to start)."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def stop() -> None:
    """Deletes the application and stops Ray Serve (its proxy and controller)."""
    serve.shutdown()
