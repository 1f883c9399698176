"""specdecode.tune.hardware: the CPU report and the watch that keeps a choice measured on a busy
machine out of the cache."""

import subprocess
import sys
import time

import pytest

from specdecode.tune import hardware

pytestmark = pytest.mark.skipif(not hardware.has_cpu_counters(), reason="needs Linux's /proc/stat")


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow  # it measures other processes' CPU use: load-dependent, kept out of the quick loop
def test_the_watch_counts_another_process_that_keeps_a_core_busy():
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 3\n"
                              "while time.monotonic() < end: pass"])
    try:
        time.sleep(0.3)  # the interpreter is up and spinning
        with hardware.CpuWatch() as watch:
            time.sleep(1.5)
    finally:
        child.wait(timeout=30)
    assert watch.others_cores > 0.6 and watch.busy, watch.others_cores


@pytest.mark.slow
def test_the_watch_leaves_out_this_processs_own_work():
    # against a window of the same length in which this process sleeps: whatever else runs here
    # shows in both, this process's own core in neither
    with hardware.CpuWatch() as resting:
        time.sleep(1.5)
    with hardware.CpuWatch() as working:
        spin(1.5)
    assert working.others_cores - resting.others_cores < 0.5, (working.others_cores, resting.others_cores)


def test_cpu_report_names_the_dispatch_level_and_threads():
    report = hardware.cpu_report()
    assert report["capability"] and report["threads"] >= 1
    assert hardware.describe(report).startswith(report["cpu"])
