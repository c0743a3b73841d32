"""Transparent huge pages for the CPU backend's page pools.

Why: on XLA:CPU a pool is ordinary process memory, and XLA allocates it with 4 KiB pages. A page
copy touches a few 16-128 KiB runs at random places in pools of hundreds of MiB, so every run
costs several TLB misses and page walks on both sides. numpy already asks Linux for
transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of 4 MiB or more, which is
why a ``numpy.copyto`` limit, or a numpy host buffer, runs on 2 MiB pages while an XLA buffer
does not. Measured (benchmarks/RESULTS.md, "Huge pages"): 128 scattered 128 KiB pages between
a 256 MiB and a 512 MiB pool, the raw copy went from ~0.69 to ~0.77 of ``numpy.copyto``.

How: after the pool is allocated (and before anything else holds it), for each of its
buffers, ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of the buffer, then
``MADV_COLLAPSE`` (Linux >= 6.1), which replaces the interior's 4 KiB pages with huge pages in
place, preserving content. Only whole huge pages inside the buffer are touched, never a
neighbour's memory. Where MADV_COLLAPSE is not available the advice still applies and the
kernel's khugepaged collapses the range over time. Where THP is disabled ("never") or the
platform is not Linux, nothing is done.

Cost: the collapse copies the range once; measured ~2 ms per MiB on this project's CPU machine
(a 2 GiB pool: ~4 s at construction). It is a construction-time cost only.

The pools keep their buffers for life: XLA:CPU reuses a donated input for the output of every
copy and every ``run()`` step whose output aliases the pool (the address was checked to stay the
same). A caller step that does not alias the pool (XLA then warns that the donation was not
usable) gets a fresh 4 KiB-page buffer: the data is correct, only the speed-up is lost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys

import jax

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_THP = "/sys/kernel/mm/transparent_hugepage"


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


@functools.lru_cache(maxsize=1)
def huge_page_size() -> int:
    """Bytes of one transparent huge page, or 0 where THP is unavailable or disabled."""
    if _libc() is None:
        return 0
    try:
        with open(os.path.join(_THP, "enabled")) as f:
            if "[never]" in f.read():
                return 0
        with open(os.path.join(_THP, "hpage_pmd_size")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _interior(address: int, nbytes: int, huge: int) -> tuple[int, int]:
    """The largest [start, end) of whole huge pages inside [address, address + nbytes)."""
    start = -(-address // huge) * huge
    end = (address + nbytes) // huge * huge
    return start, max(start, end)


def advise_huge_pages(array: jax.Array, *, collapse: bool = True) -> int:
    """Back ``array``'s CPU buffers with transparent huge pages.

    Only buffers on the CPU platform are touched (an accelerator's memory is not process
    memory). Content is preserved. Call it on a freshly allocated array that nothing else is
    using yet: ``unsafe_buffer_pointer`` waits for the buffer to be ready.

    Args:
        array: a ready ``jax.Array`` (single-device or sharded).
        collapse: also ``MADV_COLLAPSE`` now (else only advise; khugepaged collapses later).

    Returns:
        Bytes now in huge pages: the collapsed ranges (``collapse=True``), or the advised ones
        (``collapse=False``, or where the kernel has no MADV_COLLAPSE: khugepaged's job then).
        0: nothing was done (not CPU, not Linux, THP disabled, or buffers under one huge page).
    """
    huge = huge_page_size()
    libc = _libc()
    if not huge or libc is None:
        return 0
    done = 0
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        data = shard.data
        start, end = _interior(data.unsafe_buffer_pointer(), data.nbytes, huge)
        if end == start:
            continue
        if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue  # e.g. EINVAL on a kernel without THP: leave the buffer as it is
        if not collapse or libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
        elif ctypes.get_errno() in (errno.EAGAIN, errno.EINVAL):
            done += _collapse_each(libc, start, end, huge)
    return done


def _collapse_each(libc: ctypes.CDLL, start: int, end: int, huge: int, tries: int = 3) -> int:
    """Collapse [start, end) one huge page at a time, retrying transient failures.

    A whole-range MADV_COLLAPSE stops at the first huge page it cannot collapse: EAGAIN for a
    transient shortage or a page briefly locked, and EINVAL was seen too (each in ~1 test run
    in 3 on the 2-core CI machine; the per-page retry collapsed every page in those runs). EINVAL is
    also what a kernel without MADV_COLLAPSE (< 6.1) answers: the first page then fails every try
    and the rest is skipped. What fails stays advised: khugepaged may collapse it later.
    """
    done = 0
    for address in range(start, end, huge):
        for _ in range(tries):
            if libc.madvise(address, huge, MADV_COLLAPSE) == 0:
                done += huge
                break
        else:
            if done == 0 and ctypes.get_errno() == errno.EINVAL:
                return 0  # no MADV_COLLAPSE on this kernel
    return done
