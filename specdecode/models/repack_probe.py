"""Whether llama.cpp's repacked weight layouts run on this machine and build: a probe in a child
process, its answer cached per file, build and CPU. LlamaCppLM asks it when it is not told whether
to repack (repack=None), so it lives beside the backend in models/, not in tune/ (models/ does not
import tune/).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from specdecode.models.gguf_files import file_key

# a child process loads a file with repacked layouts and scores a few tokens, one call of one
# token and one of several (the kernels differ): its exit status says whether they run here
_REPACK_PROBE = """
import sys
from specdecode.models.llamacpp import LlamaCppLM
lm = LlamaCppLM(sys.argv[1], repack=True, max_rows=1, n_ctx=256, grow=False)
lm.add_row()
lm.forward([[1, 2, 3, 4, 5, 6, 7, 8]], 8)
lm.forward([[9]], 1)
"""


def repack_works(path, timeout_s: float = 600.0) -> bool:
    """Whether llama.cpp's repacked weight layouts run `path`'s weights on this machine and build.

    Why a child process: a repacked kernel that the CPU cannot run kills the process (SIGILL), as
    llama.cpp's AMX kernels do in a native build by GCC 12 on an AMX CPU (the compiler drops the
    tile configuration), and no Python handler can catch that. So the file is loaded once in a
    child with repacking on; its exit status is the answer, cached per file (path, size, mtime),
    llama-cpp-python build and CPU in the cache folder. A child that cannot finish in timeout_s
    (a loaded machine) counts as "no" and is not cached.

    Raises:
        ImportError: llama-cpp-python missing.
    """
    import json
    import subprocess

    from specdecode.models.zoo import cache_dir

    import llama_cpp

    path = Path(path)
    build = Path(llama_cpp.__file__).parent
    libraries = sorted(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in build.rglob("*.so*"))
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    key = hashlib.sha256("\n".join([file_key(path), llama_cpp.__version__, *libraries, flags]).encode())
    cached = cache_dir() / "llamacpp" / f"repack-{key.hexdigest()[:16]}.json"
    try:
        return bool(json.loads(cached.read_text(encoding="utf-8"))["works"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        child = subprocess.run([sys.executable, "-c", _REPACK_PROBE, str(path)], capture_output=True,
                               timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return False
    works = child.returncode == 0
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".partial")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"works": works, "file": path.name, "exit": child.returncode}, f)
        os.replace(tmp, cached)
    except OSError:  # a cache we cannot write costs the next load the probe again
        pass
    return works
