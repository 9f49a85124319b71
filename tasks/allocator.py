"""The process's heap, tuned for tensor work on the host: freed memory kept for the next step.

glibc's malloc serves a request above its mmap threshold with fresh pages from the kernel and, once
free memory at the top of the heap exceeds its trim threshold, hands that memory back. Both
thresholds start small (128 KiB) and move with the process's frees. The CPU stages allocate and
free tensors of tens of MiB every layer of every step (logits, their gradients, activations), so with
those defaults the heap is given back between steps and faulted in again page by page: one
optimizer step of the long `make bench-trl` size took 250,000-560,000 minor page faults and 0.5-1 s
of kernel time (`benchmarks/cpu_stages.py train --glibc-defaults`). Fixed thresholds keep that memory in the
heap, where the next step reuses it; the process's peak resident memory is unchanged, since what is
kept is at most what the step had allocated at its peak.

Environment variables that set glibc's thresholds (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_TOP_PAD_`) take precedence: with any of them set the heap is left as configured. On a C
library other than glibc nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# requests above this still get pages of their own and return them when freed (glibc's largest
# dynamic mmap threshold on 64-bit systems: a checkpoint's buffers do not stay in the heap)
MMAP_THRESHOLD_BYTES = 32 * 2**20
# free memory at the heap's top kept for reuse: above one step's working set of the CPU stages
TRIM_THRESHOLD_BYTES = 256 * 2**20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module's docstring). Returns
    whether they were set: False off glibc or where the environment sets the thresholds itself.
    Safe to call again; it takes effect for the allocations that follow."""
    if platform.libc_ver()[0] != "glibc":
        return False
    chosen = [name for name in USER_SETTINGS if name in os.environ]
    if chosen:
        logger.debug("malloc thresholds left as the environment sets them (%s)", ", ".join(chosen))
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    for parameter, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc's mallopt refused parameter {parameter} = {value} bytes")
    return True
