"""Running torch's compute well: on another thread without making it slower, and on fewer threads
while other processes keep the cores busy.

torch's CPU kernels run on OpenMP (libgomp in the PyPI wheels). Every thread that runs a parallel
region keeps a pool of OpenMP worker threads alive afterwards. When the threads that libgomp
manages outnumber the CPUs, it stops spinning on its barriers (its "throttled" mode) and every
parallel region pays a sleep/wake: after the models are loaded on the main thread, the same
896x4864 bf16 linear layer took 197 us on a new thread against 146 us on the main thread
(2-core EPYC, torch 2.13), and a speculative server step 400 ms against 270 ms. Freeing the loading
thread's pool (OpenMP 5.0's `omp_pause_resource_all`, which frees the calling thread's pool) before
the compute thread starts brings the new thread back to 144 us.

The same barriers make a parallel region as slow as its slowest thread: beside two CPU-bound
processes on that 2-core machine, the default pair (batch-invariant bfloat16 target, int4 draft)
decoded 13.6 tokens/s on two threads and 28 on one (idle: 53-74 on two, 40-47 on one; one process
each, interleaved). ThreadGovernor runs the compute on the cores the others leave.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable

import torch


log = logging.getLogger("specdecode")

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads and everything else they hold


def _openmp_library():
    """The OpenMP runtime torch loaded (ctypes.CDLL), or None where it cannot be found (not Linux,
    or no OpenMP)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp", "libomp")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def free_openmp_threads() -> bool:
    """Free the calling thread's idle OpenMP worker threads (call it from the thread that loaded the
    models, before another thread takes over the compute; it runs again if this thread runs torch).

    Returns:
        True when the runtime freed them; False where it could not be found or refused (nothing
        changes then: compute on the other thread is slower, not wrong).
    """
    library = _openmp_library()
    if library is None or not hasattr(library, "omp_pause_resource_all"):
        return False
    freed = library.omp_pause_resource_all(ctypes.c_int(_OMP_PAUSE_HARD)) == 0
    if not freed:
        log.debug("omp_pause_resource_all refused; torch on the engine thread may run slower")
    return freed


class ComputeThread(threading.Thread):
    """A thread that takes over this process's torch compute from the thread that creates it: it
    keeps the creator's torch thread count (OpenMP's is per thread), and the starting thread's idle
    OpenMP workers are freed when it starts. The starting thread should not run torch afterwards
    (it would bring its pool back).

    Args:
        target: the callable the thread runs (no arguments).
        name: the thread's name.
    """

    def __init__(self, target, name: str, daemon: bool = True):
        super().__init__(name=name, daemon=daemon)
        self._compute, self._torch_threads = target, torch.get_num_threads()

    def start(self) -> None:
        free_openmp_threads()
        super().start()

    def run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        self._compute()


def busy_seconds(cpus: set[int] | None = None) -> float | None:
    """CPU seconds the machine has spent busy since boot (/proc/stat: user, nice, system, irq,
    softirq and steal, the hypervisor's share), over these CPUs (None: all); None where /proc/stat
    is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    if cpus is None:
        lines = lines[:1]  # the first line sums every CPU
    else:
        lines = [line for line in lines[1:] if line[0][3:].isdigit() and int(line[0][3:]) in cpus]
    try:
        ticks = [sum(int(x) for x in line[1:9]) - int(line[4]) - (int(line[5]) if len(line) > 5 else 0)
                 for line in lines]  # less idle and iowait
    except (ValueError, IndexError):
        return None
    return sum(ticks) / os.sysconf("SC_CLK_TCK") if ticks else None


def own_seconds() -> float:
    """CPU seconds this process (and its waited-for children) has used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity set; all of them where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class OthersMeter:
    """Cores of this process's CPU set that other processes kept busy, on average, since the last
    read (the first read: since construction); 0.0 where /proc/stat is missing."""

    def __init__(self):
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._last = busy_seconds(self.cpus), own_seconds(), time.monotonic()

    def __call__(self) -> float:
        now = busy_seconds(self.cpus), own_seconds(), time.monotonic()
        last, self._last = self._last, now
        if now[0] is None or last[0] is None or now[2] <= last[2]:
            return 0.0
        return max(0.0, ((now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2]))


# The count a governor last set torch to, and the count it lowered it from (the user's, the CLI's
# --threads): where torch's count is still the governor's, the requested one is the latter.
_governed: dict = {"set": None, "from": None}


def requested_threads() -> int:
    """torch's thread count as the user or the CLI set it: where a governor has lowered it for
    other processes' load, the count it was lowered from. The choice's key and prior
    (tune.hardware.cpu_report) and every new governor read this, so that a second decoder built
    while the first computes on fewer threads is planned for the machine, not for the moment."""
    now = torch.get_num_threads()
    return _governed["from"] if _governed["set"] == now and _governed["from"] is not None else now


class ThreadGovernor:
    """Compute on the cores other processes leave free: every `interval` seconds (read at tick(),
    between engine steps, on the compute thread) the torch thread count becomes the cores of this
    process's CPU set less those others kept busy since the last look, rounded, within
    [1, max_threads]. Use it only where the kernels' bits do not depend on the thread count (the
    batch-invariant ones: threads split output columns, never a sum), so the tokens never change.

    Args:
        max_threads: the cap (default: requested_threads(), torch's count as `--threads` set it).
        cores: the CPUs this process may run on (default: its affinity set's size).
        interval: seconds between looks.
        others: a callable giving the cores others kept busy since its last call (default: an
            OthersMeter); tests pass their own.
        clock: seconds, monotonic.
    Attributes:
        changes: how many times the thread count changed.
    """

    def __init__(self, max_threads: int | None = None, cores: int | None = None, interval: float = 1.0,
                 others: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic):
        self.max_threads = max_threads or requested_threads()
        self.cores = cores or usable_cpus()
        self.interval, self.clock = interval, clock
        self.others = others or OthersMeter()
        self.changes = 0
        self._last_look = clock()

    def release(self) -> None:
        """Give torch back the thread count it was lowered from (the engine calls this when it has
        no work left; the next tick looks again)."""
        if _governed["set"] == torch.get_num_threads() and _governed["from"] is not None:
            torch.set_num_threads(_governed["from"])
            self._last_look = self.clock() - self.interval  # the next step looks at once
        _governed.update({"set": None, "from": None})

    def tick(self) -> None:
        now = self.clock()
        if now - self._last_look < self.interval:
            return
        self._last_look = now
        want = max(1, min(self.max_threads, round(self.cores - self.others())))
        if want != torch.get_num_threads():
            log.debug("compute threads %d -> %d (other processes' load)", torch.get_num_threads(), want)
            requested = requested_threads()
            torch.set_num_threads(want)
            _governed.update({"set": want, "from": requested})
            self.changes += 1
