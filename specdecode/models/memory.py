"""Handing freed memory back to the system, so that the next large allocation's peak is its own."""

from __future__ import annotations

import ctypes
import gc


def release() -> None:
    """Free what dropped objects held: their reference cycles (transformers models hold some), then
    glibc's freed pages back to the system (malloc_trim: numpy's and torch's temporaries below
    glibc's mmap threshold otherwise stay resident; elsewhere a no-op)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_MADV_DONTNEED = 4


def drop_file_pages(tensor) -> int:
    """Drop from this process the resident pages of a CPU tensor that lies in a private mapping of
    a file (a safetensors weight transformers memory-mapped) and that it will not read soon.

    They stay the file's: a later read faults them back in with the same bytes, so the tensor stays
    valid. Memory no file backs (heap, anonymous) is never touched (dropping it would zero it).
    Used when a weight has been copied into another layout (the batch-invariant forward's fused
    q|k|v and gate|up): otherwise the pages its copy read stay counted in the resident set beside
    the copy, 1.7 GB for the default target.

    Args:
        tensor: any torch tensor.
    Returns:
        bytes dropped (0 off Linux, for other devices and for memory no file backs).
    """
    import mmap
    import sys

    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not _in_file_mapping(start, end):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if last <= first:
        return 0
    try:
        madvise = ctypes.CDLL("libc.so.6").madvise
    except (OSError, AttributeError):  # another C library (musl): the pages stay, nothing breaks
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return last - first if madvise(first, last - first, _MADV_DONTNEED) == 0 else 0


def _in_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one private mapping of a regular file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= start and end <= high:
                    return len(fields) == 6 and fields[5].startswith("/") and fields[1][3] == "p" \
                        and fields[4] != "0"
    except (OSError, ValueError, IndexError):
        pass
    return False
