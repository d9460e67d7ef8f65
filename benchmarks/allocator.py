"""The process's memory allocator: glibc's default, or glibc keeping freed memory for reuse.

With glibc's defaults, every allocation above its mmap threshold (at most 32 MiB, so every
sequence-sized tensor of the issue's sizes) is a fresh ``mmap`` that the kernel zero-fills page by
page on first touch, and is handed back to the kernel when freed: each call of a layer pays for
faulting in all its large intermediates again. On the 2-core development machine an empty
32 MiB tensor filled once took 12-16 ms, against 1-2 ms for the same fill into memory already
mapped. ``keep_freed_memory`` makes glibc serve large blocks from its heap and keep freed memory
(``mallopt``, the same as ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` in the
environment), as PyTorch's CPU performance guide advises through jemalloc or tcmalloc. It affects
every row of a run alike; a run records which allocator it used.
"""
from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Large enough that no tensor of a benchmark is mmapped or trimmed back to the kernel.
KEEP_BYTES = 2**31 - 1


#: How a run that leaves the allocator alone names it.
DEFAULT = "the C library's default malloc"


def allocator(keep_freed: bool) -> str:
    """The allocator a run uses, named for its header: glibc keeping freed memory where
    ``keep_freed`` (``keep_freed_memory``, set here), else the default (``DEFAULT``)."""
    return keep_freed_memory() if keep_freed else DEFAULT


def keep_freed_memory() -> str:
    """Make glibc keep freed memory and serve large blocks from its heap; returns what was set.

    Raises ``OSError`` where the C library is not glibc or refuses the settings.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        raise OSError("no C library found to configure")
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        raise OSError(f"{name} is not glibc: keep freed memory with jemalloc or tcmalloc instead")
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        if libc.mallopt(option, KEEP_BYTES) != 1:
            raise OSError(f"glibc refused mallopt({option}, {KEEP_BYTES})")
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    return (f"glibc {version} malloc keeping freed memory (mallopt M_MMAP_THRESHOLD and "
            f"M_TRIM_THRESHOLD = {KEEP_BYTES})")


__all__ = ["keep_freed_memory", "allocator", "DEFAULT"]
