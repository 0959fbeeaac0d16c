"""The C allocator of a process that runs models: freed memory kept for the next batch.

glibc's malloc hands a large freed block back to the kernel (blocks above a threshold that moves
between 128 KiB and 32 MiB are mapped one by one, and the heap's top is trimmed past 128 KiB), so
the next batch's tensors of that size arrive as fresh pages, each zero-filled by the kernel on its
first touch. A forward on a CPU frees and allocates such blocks every batch. On the bench's d256x4
llama (causal_loss over one C4 shard, 2 threads) that was 4-5 M page faults and 9-12 s of kernel
time a run; kept, 0.2 M and 1.2 s: in fp32 the score path 5-10 % faster and a bare forward 15 %, in
bf16 the path unchanged and a bare forward 5 % (alternated processes, docs/scoring.md). A training
step measured no faster (d256x4, fp32), so the trainer leaves its allocator alone. PyTorch's CPU
tuning guide gets the same through jemalloc or tcmalloc (LD_PRELOAD); glibc's own `mallopt` needs
nothing installed. The price: the process keeps its peak heap until it exits, as a batch worker
does anyway.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = (
    (M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest: blocks up to 32 MiB come from the heap, reused
    (M_TRIM_THRESHOLD, (1 << 31) - 1),  # never give the heap's top back (an int: the largest one)
    (M_TOP_PAD, 256 << 20),  # and grow it 256 MiB at a time (address space: pages count once touched)
)
_kept: bool | None = None  # once a process


def keep_freed_memory() -> bool:
    """Once per process: glibc keeps freed memory for reuse (`SETTINGS`). True where it was set;
    False elsewhere (another C library or platform, whose allocator is left as it is)."""
    global _kept
    if _kept is None:
        _kept = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                mallopt = ctypes.CDLL("libc.so.6").mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _kept = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _kept
