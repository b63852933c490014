"""Host memory for the commands that run a model on a CPU: freed blocks stay in the process.

PyTorch's CPU tensors come from the C library's ``malloc`` with no cache of its own. glibc serves every
block above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on
free, so each large activation of a forward (an experts call's ``[tokens x k, H]`` slots, a scoring
chunk's logits) is page-faulted in again, page by page, on its first write. On the 2-core test machine a
32 MiB fresh buffer took 23 ms to fill against 3 ms for one reused, and a scoring pass of the test-bed
ran 15-20% faster with freed memory kept (bench/RESULTS.md, "Freed memory kept").

``keep_freed_memory`` asks glibc to serve large blocks from its heap and not to trim it: a freed block is
reused by the next forward's block of the same size, already mapped. The cost is that the process keeps
its peak heap until it exits, which a command that runs one model to the end does anyway. Nothing
changes in what is computed, only where the bytes live. ``SERE_FX_KEEP_FREED_MEMORY=0`` leaves
``malloc`` as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
ENV = "SERE_FX_KEEP_FREED_MEMORY"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Keep freed memory in this process (glibc: no ``mmap`` per large block, no heap trimming). True where
    it applies; False on another C library or with ``SERE_FX_KEEP_FREED_MEMORY=0``. Idempotent."""
    global _applied
    if _applied is not None:
        return _applied
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 or 1, got {value!r}")
    _applied = False
    if value == "1":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            version = libc.gnu_get_libc_version  # glibc only: musl and macOS have no such function
        except (OSError, AttributeError):
            return _applied
        version.restype = ctypes.c_char_p
        # mallopt returns 1 on success; the trim threshold is the largest positive int it takes
        _applied = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return _applied
