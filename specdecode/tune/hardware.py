"""What this CPU offers the matrix products a decoder runs on: torch's dispatch level, whether
bfloat16 has a native fast path, and the instruction-set flags every benchmark prints.

Machines differ from run to run (a cloud VM of another generation, an AVX2-only desktop), and a
bfloat16 product of more than one row is several times slower without native bfloat16 (oneDNN
needs AVX-512 or AMX for it; without them torch falls back to a scalar-converting loop). Every
speed number is only comparable within one machine, so every report carries this one.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from specdecode.engine.threads import busy_seconds, own_seconds, requested_threads
from specdecode.models import kernels

# The flags that decide which kernels run (x86 and ARM names as /proc/cpuinfo spells them).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")
# Environment variables that make this machine act as an older one (docs/auto-configuration.md: all three
# emulate an AVX2-only CPU): they must show in every report made under them.
EMULATION_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


# Cores other processes may keep busy, on average, while the candidates are timed before the choice
# is left out of the cache: a compile and a second model load beside the first start made a 38 ms
# llama.cpp step read 6.4 s and the chooser pick a draft that plain decoding beats.
BUSY_CORES = 0.5


class CpuWatch:
    """A context manager: how many cores other processes kept busy, on average, while it was open.

    others_cores: float, from the machine's busy time (/proc/stat: user, nice, system, irq,
    softirq and steal, the hypervisor's share) less this process's own and its children's
    (os.times), over the wall time; 0.0 where /proc/stat is missing.  busy: others_cores >=
    BUSY_CORES.
    """

    others_cores = 0.0

    def __enter__(self) -> "CpuWatch":
        self._start = busy_seconds(), own_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.others_cores = self.so_far()

    def so_far(self) -> float:
        """Cores other processes kept busy, on average, from entry until now."""
        machine, own, wall = busy_seconds(), own_seconds(), time.monotonic()
        if machine is None or self._start[0] is None or wall <= self._start[2]:
            return 0.0
        return max(0.0, ((machine - self._start[0]) - (own - self._start[1])) / (wall - self._start[2]))

    @property
    def busy(self) -> bool:
        return self.others_cores >= BUSY_CORES

    def busy_so_far(self) -> bool:
        return self.so_far() >= BUSY_CORES


def idle_now(seconds: float = 0.5) -> bool:
    """Whether other processes leave this machine's cores free (fewer than BUSY_CORES busy over a
    short look); True where /proc/stat is missing."""
    with CpuWatch() as watch:
        time.sleep(seconds)
    return not watch.busy


def has_cpu_counters() -> bool:
    """Whether CpuWatch can see other processes here (Linux's /proc/stat)."""
    return busy_seconds() is not None


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                if key == "" and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return name, flags


def native_bfloat16() -> bool:
    """Whether a bfloat16 matrix product of several rows has a native kernel here (oneDNN's
    AVX-512-BF16 / AMX path on x86; it honours ONEDNN_MAX_CPU_ISA). CUDA devices are not asked."""
    return kernels.onednn_bfloat16_supported()


def cpu_report() -> dict:
    """{"cpu": model name, "capability": torch's CPU dispatch level (e.g. "AVX2", "AVX512"),
    "native_bfloat16": bool, "flags": the KERNEL_FLAGS present, "threads": torch's intra-op
    threads, "torch": version, "emulated": {variable: value} of EMULATION_VARIABLES that are set}."""
    name, flags = _cpuinfo()
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(),
            "native_bfloat16": native_bfloat16(), "flags": [f for f in KERNEL_FLAGS if f in flags],
            "threads": requested_threads(), "torch": torch.__version__,
            "emulated": {k: os.environ[k] for k in EMULATION_VARIABLES if os.environ.get(k)}}


def describe(report: dict) -> str:
    """One line for a benchmark header or a log: 'AMD EPYC, AVX512, native bfloat16, flags ...'."""
    emulated = ", emulating " + " ".join(f"{k}={v}" for k, v in report["emulated"].items()) if report["emulated"] else ""
    return (f"{report['cpu']}, torch capability {report['capability']}, "
            f"{'native' if report['native_bfloat16'] else 'no native'} bfloat16, {report['threads']} threads, "
            f"flags {' '.join(report['flags']) or 'none'}{emulated}")
