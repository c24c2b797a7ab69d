"""glibc's malloc told to keep the memory a training step frees, instead of handing it back to the kernel and
faulting it in again at the next step.

A CPU update allocates and frees the same activations, logits and gradients every time. glibc serves a block
over its mmap threshold with a mapping of its own, unmapped when freed, and gives the top of its heap back to
the kernel once more than its trim threshold lies free there; both start at 128 KiB and rise only as mapped
blocks are freed. Every page handed back is a page fault and a zeroed page the next time: bench-tiny's GRPO
update faulted 13-20k times (~70 MB) per update, 4-7 % of its time (bench/RESULTS.md, 2026-11-28). With the
thresholds fixed below it faults a few hundred times, at the same peak RSS.

MMAP_THRESHOLD is glibc's own ceiling for the rising threshold (32 MiB on 64-bit): a larger block still gets
its own mapping, returned when freed, so a one-off large tensor does not stay resident. TRIM_THRESHOLD bounds
what the heap keeps free at its top (64 MiB). Where tensors live changes, never a result: torch aligns every
CPU tensor itself (64 bytes) whatever malloc returns. `RLHF_KEEP_FREED_MEMORY=0` leaves glibc's defaults;
elsewhere than glibc (macOS, musl) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

ENV = "RLHF_KEEP_FREED_MEMORY"
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_kept = False


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's thresholds for this process (once); whether they are set."""
    global _kept
    if _kept:
        return True
    if env.get(ENV, "1").strip() in {"0", "false", "no", "off"} or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    # the mmap threshold first: fixing the trim threshold alone stops glibc raising the mmap one, and every block
    # over 128 KiB would then be mapped and unmapped (measured: 7x the faults of the defaults)
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept
