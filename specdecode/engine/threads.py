"""Handing torch's compute to another thread without making it slower.

torch's CPU kernels run on OpenMP (libgomp in the PyPI wheels). Every thread that runs a parallel
region keeps a pool of OpenMP worker threads alive afterwards. When the threads that libgomp
manages outnumber the CPUs, it stops spinning on its barriers (its "throttled" mode) and every
parallel region pays a sleep/wake: after the models are loaded on the main thread, the same
896x4864 bf16 linear layer took 197 us on a new thread against 146 us on the main thread
(2-core EPYC, torch 2.13), and a speculative server step 400 ms against 270 ms. Freeing the loading
thread's pool (OpenMP 5.0's `omp_pause_resource_all`, which frees the calling thread's pool) before
the compute thread starts brings the new thread back to 144 us.
"""

from __future__ import annotations

import ctypes
import logging
import threading

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
