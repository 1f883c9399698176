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
