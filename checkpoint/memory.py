"""Handing the heap memory the loader frees back to the OS (GGUF reading and the model build call it)."""
from __future__ import annotations

import functools


def release_freed_memory() -> None:
    """Hand the heap memory freed since the last call back to the OS.  glibc keeps it otherwise, and
    the loader frees as much as it builds (unfused weights, row-major codes): trimming after each layer
    keeps the load's peak at the model's size (fp32 default model: peak +578 MB, not +669).  A no-op
    where there is no glibc."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes
    return ctypes.CDLL("libc.so.6")
