"""engine/threads.py: the engine thread keeps the caller's torch thread count, and the caller's idle
OpenMP pool is freed when it starts (the speed this buys is measured in docs/results/serve_load.md)."""

import sys

import pytest
import torch

from specdecode.engine import threads


def test_the_compute_thread_keeps_the_callers_torch_thread_count():
    before = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        thread = threads.ComputeThread(lambda: seen.append(torch.get_num_threads()), name="t")
        thread.start()
        thread.join(30)
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenMP runtime is found through /proc/self/maps")
def test_the_openmp_runtime_torch_loaded_is_found_and_frees_the_callers_pool():
    torch.ones(256, 256) @ torch.ones(256, 256)  # this thread now holds a pool
    library = threads._openmp_library()
    if library is None:
        pytest.skip("this torch build loads no OpenMP runtime")
    assert threads.free_openmp_threads() is True
    assert torch.allclose(torch.ones(64, 64) @ torch.ones(64, 64), torch.full((64, 64), 64.0))  # torch still works


def test_the_compute_thread_frees_the_callers_pool_when_it_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(threads, "free_openmp_threads", lambda: calls.append("freed") or True)
    thread = threads.ComputeThread(lambda: calls.append("ran"), name="t")
    assert calls == []
    thread.start()
    thread.join(30)
    assert calls == ["freed", "ran"]
