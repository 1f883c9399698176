"""Joining a Ray cluster, or starting a local one, for the scale-out commands; and giving each Ray
worker's torch the CPUs Ray assigned it."""

from __future__ import annotations

import glob
import os
import signal
import socket
import tempfile

import ray

# A local cluster serves this machine's one job: a small object store (rows, records and requests
# are text), no dashboard.
LOCAL_OBJECT_STORE_BYTES = 128 << 20

# the session directory of the local cluster this process started (connect without an address),
# whose processes disconnect may stop; None while it started none
_local_session: str | None = None


def connect(address: str | None, quiet: bool, num_cpus: int | None = None) -> bool:
    """Connects to the cluster at `address` ("auto", "HOST:PORT", "ray://HOST:10001"), or starts a
    local one on 127.0.0.1 with num_cpus (default: this machine's) when address is None.
    Returns True if this call connected this process (the caller then calls disconnect(True)),
    False if Ray was already initialized here (left as it is).

    Raises:
        ConnectionError: no cluster at `address`.
    """
    global _local_session
    if ray.is_initialized():
        return False
    common = dict(log_to_driver=not quiet, logging_level="WARNING")
    if address is not None:
        _check_listening(address)
    connected = False
    try:
        if address is None:
            ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, **common)
        else:
            ray.init(address=address, **common)
        connected = True
    finally:
        _local_session = _session_dir() if address is None else None
        if not connected:  # a start cut short (Ctrl-C) would leave the processes it had started running
            disconnect(True)
    return True


def _check_listening(address: str) -> None:
    """Raises ConnectionError at once for a HOST:PORT where nothing listens (ray.init retries
    such an address for minutes); "auto" and "ray://" addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise ConnectionError(f"no Ray cluster at {address} ({err.strerror or err}); start one there with "
                              "`ray start --head`, or leave out the address for a local cluster") from None


def disconnect(started: bool) -> None:
    """Stops the cluster when this process started it (connect returned True) and disconnects;
    else leaves Ray as it is (the caller's own session, or a cluster it joined)."""
    global _local_session
    if not started:
        return
    session, _local_session = _local_session, None
    if session:
        _stop_autoscaler_monitor()
    ray.shutdown()
    if session:
        _kill_stragglers(session)


def _ray_node():
    """Ray's object for the node this process started or joined (private to Ray, so every use is
    guarded), or None."""
    return getattr(ray._private.worker, "_global_node", None)


def _session_dir() -> str | None:
    """The session directory of the local cluster this process is starting or runs, or None.
    While ray.init is cut short Ray's node object may not exist yet, and then the newest session named after this process's pid is the one (Ray names it
    session_<date>_<pid>)."""
    node = _ray_node()
    if node is not None and hasattr(node, "get_session_dir_path"):
        return node.get_session_dir_path()
    root = os.environ.get("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
    sessions = glob.glob(os.path.join(root, f"session_*_{os.getpid()}"))
    return max(sessions, key=os.path.getmtime) if sessions else None


def _stop_autoscaler_monitor() -> None:
    # ray.shutdown stops the GCS before the autoscaler monitor, whose SIGTERM handler then blocks
    # reporting to the stopped GCS until Ray kills it one second later (Ray 2.60: 1.0 of the 1.4 s
    # shutdown). A local cluster gives the monitor nothing to finish, so kill it first. Ray's node
    # object is private: where it is not there, shutdown just takes the second.
    for info in getattr(_ray_node(), "all_processes", {}).get("monitor", []):
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(timeout=5)


def _kill_stragglers(session_dir: str) -> None:
    # Stopped while it is still starting (Ctrl-C in the first seconds), the raylet can leave its
    # dashboard and runtime-env agents running, reparented to init, for good (Ray 2.60; they
    # rename themselves, so only their open log files under the session directory name them).
    # A cluster this process started owns that directory: nothing else may outlive it.
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if any(os.readlink(f"/proc/{entry}/fd/{fd}").startswith(session_dir + os.sep)
                   for fd in os.listdir(f"/proc/{entry}/fd")):
                os.kill(int(entry), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to inspect
            continue


def check_models(config: dict) -> None:
    """Fails fast, before Ray starts, on a target or draft that cannot load on this machine (for a
    local cluster, whose workers load them here; Ray would otherwise retry a failing actor).

    Raises:
        ValueError: as models.loading.check_model_spec.
    """
    from specdecode.models import zoo
    from specdecode.models.loading import check_model_spec

    for key, default in (("target", zoo.DEFAULT_TARGET), ("draft", zoo.DEFAULT_DRAFT)):
        spec = config.get(key, "default")
        if spec is not None:
            check_model_spec(default if spec == "default" else spec)


def use_assigned_cpus() -> None:
    """In a Ray actor: torch's threads = the CPUs Ray assigned it (Ray sets OMP_NUM_THREADS to
    them, but torch may already have read its own default)."""
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus:
        torch.set_num_threads(max(1, int(cpus)))
