"""The C allocator of a process whose whole job is checking: large blocks go back to the OS.

glibc serves a block of 128 KiB or more with its own mmap, returned to the OS on free, but after
the first such block is freed it raises that threshold to the block's size (up to 32 MiB), and
from then on serves blocks that large from its heaps, where a freed block stays with the process.
A plan check frees large blocks all the time (a weight's gradient compared, then dropped; the
buffers of an all-reduce) on several rank threads, each with a heap of its own, so every heap
keeps its own high-water mark: on a 4.2 M-parameter MLP on a (2, 2) mesh the check's peak was
95 bytes per parameter, of which about 35 were freed blocks kept, and 37 B without them
(benchmarks/bench_plan_memory.py). Fixing the threshold at 1 MiB keeps the small blocks of op
checks in the heaps and sends the large ones back as soon as they are freed.

Each rank thread also had a heap (an "arena") of its own, and the blocks under the threshold
that a rank freed (its activations, 0.4-1.5 MB each in GPT-2 small) stayed in its arena for that
thread alone: GPT-2 small's replicated check held 2 B/param more after each rank had run (44.2
B/param at the peak). The simulated ranks run one at a time, so they lose nothing by sharing one
arena, and the next rank reuses what the last one freed (39.2 B/param). A checking process
therefore keeps to a single arena.

A block mmapped fresh is paid for again in page faults as it is first written: 4 KiB at a time,
in the kernel, on this process's CPU time.  At large shapes that was most of a check: sum on a
(2, 2) mesh at 16x the grid's leading dims (a 32 MiB input, each rank's block a copy) took 13.8 s
of system time against 10.2 s of user time, 5.9 M page faults.  torch lays a tensor of 2 MiB or
more on transparent huge pages when ``THP_MEM_ALLOC_ENABLE`` is set (where the kernel offers them
on request): a 32 MiB copy then faults 529 times, not 8,194, and that check took 40% less CPU
time (85 ms a layout, warm, to 51; linear's at 16x, 26% less).  Its peak memory did not grow
(benchmarks/bench_plan_memory.py: the same bytes per parameter), since such a block is at most
one huge page larger.  torch reads the setting once,
at the first tensor that large, so a checking process sets it before making one; the processes
it starts inherit it.

Like the collector thresholds (gc_policy), only the processes that exist to check set it.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["MMAP_THRESHOLD", "HUGE_PAGES", "return_large_frees", "huge_pages_for_large_tensors"]

#: blocks of at least this many bytes are mmapped and returned to the OS when freed
MMAP_THRESHOLD = 1 << 20
#: the environment variable by which torch's CPU allocator puts tensors of 2 MiB or more on huge pages
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
_M_MMAP_THRESHOLD = -3      # mallopt's parameter numbers in glibc's malloc.h
_M_ARENA_MAX = -8


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and its arenas at one for this process;
    False where the C library is not glibc (nothing changes there)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1 and mallopt(_M_ARENA_MAX, 1) == 1


def huge_pages_for_large_tensors() -> bool:
    """Ask torch to lay this process's tensors of 2 MiB or more on transparent huge pages (and so
    those of the processes it starts), unless the environment already says either way; whether
    it is asked now.  Effective only before the process's first tensor that large."""
    if platform.system() != "Linux" or HUGE_PAGES in os.environ:
        return False
    os.environ[HUGE_PAGES] = "1"
    return True
