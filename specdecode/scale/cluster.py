"""Joining a Ray cluster, or starting a local one, for the scale-out commands; and giving each Ray
worker's torch the CPUs Ray assigned it."""

from __future__ import annotations

import os

import ray

# A local cluster serves this machine's one job: a small object store (rows, records and requests
# are text), no dashboard.
LOCAL_OBJECT_STORE_BYTES = 128 << 20


def connect(address: str | None, quiet: bool, num_cpus: int | None = None) -> bool:
    """Connects to the cluster at `address` ("auto", "HOST:PORT", "ray://HOST:10001"), or starts a
    local one on 127.0.0.1 with num_cpus (default: this machine's) when address is None.
    Returns True if this call started Ray here (the caller shuts it down).

    Raises:
        ConnectionError: no cluster at `address`.
    """
    if ray.is_initialized():
        return False
    common = dict(log_to_driver=not quiet, logging_level="WARNING")
    if address is None:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, **common)
    else:
        ray.init(address=address, **common)
    return True


def disconnect(started: bool) -> None:
    """Leaves the cluster; stops it when this process started it (connect returned True)."""
    if not started:
        return
    _stop_autoscaler_monitor()
    ray.shutdown()


def _stop_autoscaler_monitor() -> None:
    # ray.shutdown stops the GCS before the autoscaler monitor, whose SIGTERM handler then blocks
    # reporting to the stopped GCS until Ray kills it one second later (Ray 2.60: 1.0 of the 1.4 s
    # shutdown). A local cluster gives the monitor nothing to finish, so kill it first. Ray's node
    # object is private: where it is not there, shutdown just takes the second.
    node = getattr(ray._private.worker, "_global_node", None)
    for info in getattr(node, "all_processes", {}).get("monitor", []):
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(timeout=5)


def check_models(decoder_kwargs: dict) -> None:
    """Fails fast, before Ray starts, on a target or draft that cannot load on this machine (for a
    local cluster, whose workers load them here; Ray would otherwise retry a failing actor).

    Raises:
        ValueError: as models.loading.check_model_spec.
    """
    from specdecode.models import zoo
    from specdecode.models.loading import check_model_spec

    for key, default in (("target", zoo.DEFAULT_TARGET), ("draft", zoo.DEFAULT_DRAFT)):
        spec = decoder_kwargs.get(key, "default")
        if spec is not None:
            check_model_spec(default if spec == "default" else spec)


def use_assigned_cpus() -> None:
    """In a Ray actor: torch's threads = the CPUs Ray assigned it (Ray sets OMP_NUM_THREADS to
    them, but torch may already have read its own default)."""
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus:
        torch.set_num_threads(max(1, int(cpus)))
