"""Compile rows.cpp and kquants.cpp for this machine once and load them (ctypes).

The library is built on first use with the system's C++ compiler (`c++`/`g++`, or $CXX) for this
CPU's instruction sets (-march=native: AVX-512 BF16, AVX2 + FMA or portable code, decided by the
compiler's macros) and cached under the specdecode cache (`native/`, keyed by the source, the
compiler, the flags and the CPU), so a later start loads it in milliseconds. The build takes about
3 seconds on 2 cores. Where no compiler exists, `load()` raises NativeUnavailable with the command
that installs one, and everything else runs on torch's kernels.

Threads. The kernels use OpenMP. They are linked against the OpenMP runtime torch itself loaded
(where torch ships its own copy), so that torch's operators and these kernels share one pool of
threads instead of two pools spinning against each other on the same cores.

$SPECDECODE_NATIVE_MARCH replaces "native" in -march (e.g. "haswell" builds the AVX2 path on an
AVX-512 machine, to measure that class of CPU); $SPECDECODE_NATIVE=0 turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = [Path(__file__).with_name(name) for name in ("rows.cpp", "kquants.cpp")]
ISA_NAMES = {2: "avx512-bf16", 1: "avx2-fma", 0: "portable"}


class NativeUnavailable(RuntimeError):
    """The batch-invariant kernels cannot be built or loaded here (the message says why and what to
    install)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _torch_openmp() -> Path | None:
    """The OpenMP runtime torch ships in torch/lib (libgomp-<hash>.so.1), if any."""
    import torch

    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags)."""
    march = os.environ.get("SPECDECODE_NATIVE_MARCH", "native")
    compile_flags = ["-O3", f"-march={march}", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC",
                     "-std=c++17"]
    gomp = _torch_openmp()
    link = ["-shared"] + ([str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else ["-fopenmp"])
    return compile_flags, link


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where this machine's build lives (built or not)."""
    from specdecode.models.zoo import cache_dir

    compiler = _compiler() or "none"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout if compiler != "none" \
        else ""
    key = hashlib.sha256("\n".join([*(source.read_text() for source in SOURCES), compiler, version, repr(_flags()), _cpu_flags()])
                         .encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"rows-{key}.so"


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernels (built on first use, then cached on disk).

    Raises:
        NativeUnavailable: $SPECDECODE_NATIVE=0, no C++ compiler, a failed build (with the
            compiler's first error lines), a cache folder that cannot be written, or a build that
            does not load.
    """
    if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
        raise NativeUnavailable("the batch-invariant kernels are turned off ($SPECDECODE_NATIVE=0)")
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C++ compiler found for the batch-invariant kernels (install one, e.g. "
                                "'apt-get install g++'; until then torch's kernels run)")
    path = library_path()
    if not path.exists():
        logging.getLogger("specdecode").info("building the batch-invariant kernels for this CPU (once, a few seconds): "
                                             "%s", path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.partial")
        except OSError as err:
            raise NativeUnavailable(f"cannot write the batch-invariant kernels' build to {path.parent}: {err}") from None
        os.close(fd)
        compile_flags, link_flags = _flags()
        objects = [f"{tmp}.{source.stem}.o" for source in SOURCES]
        for source, obj in zip(SOURCES, objects):
            done = subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", obj], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                break
        else:
            done = subprocess.run([compiler, *objects, *link_flags, "-o", tmp], capture_output=True, text=True)
        for obj in objects:
            Path(obj).unlink(missing_ok=True)
        if done.returncode != 0:
            os.unlink(tmp)
            first = "\n".join(done.stderr.strip().splitlines()[:5])
            raise NativeUnavailable(f"building the batch-invariant kernels failed ({compiler}):\n{first}")
        os.replace(tmp, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:  # a build for another machine, a damaged file: built again next time
        path.unlink(missing_ok=True)
        raise NativeUnavailable(f"loading the batch-invariant kernels failed ({err}); the next start builds them "
                                "again") from None
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.sd_isa.restype = i32
    lib.sd_kq_isa.restype = i32
    lib.sd_kq_row_bytes.argtypes, lib.sd_kq_row_bytes.restype = [i32, i64], i64
    lib.sd_kq_tiled_above.argtypes, lib.sd_kq_tiled_above.restype = [i64], i64
    lib.sd_linear_kq.argtypes = [ptr, i64, i64, i64, i32, ptr, ptr, ptr, ptr, ptr, i64, i32, i32]
    lib.sd_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
    lib.sd_linear_q4.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i32]
    lib.sd_rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr, i32]
    lib.sd_silu_mul.argtypes = [ptr, ptr, i64, i64, i64, ptr, i32]
    lib.sd_rope_split.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i32]
    lib.sd_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr, f32, ptr, i32]
    for name in ("sd_linear", "sd_linear_q4", "sd_linear_kq", "sd_rms_norm", "sd_silu_mul", "sd_rope_split", "sd_attention"):
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    """Whether the kernels can be built and loaded here (builds them on the first call)."""
    try:
        load()
        return True
    except NativeUnavailable:
        return False


def isa() -> str:
    """The instruction set the build uses: "avx512-bf16", "avx2-fma" or "portable".

    Raises:
        NativeUnavailable: as load().
    """
    return ISA_NAMES[load().sd_isa()]
