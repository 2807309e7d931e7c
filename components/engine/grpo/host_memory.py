"""How glibc malloc serves a GRPO step's CPU tensors: reuse freed memory (fast) without letting it pile up.

glibc serves every allocation above its mmap threshold (`32 MiB` at most) with fresh pages and returns
them to the kernel on free, so each GRPO step page-faults its vocabulary-sized tensors (the logits,
their log-softmax, their gradient) back in. Serving them from the heap and keeping
freed memory there removes those faults (`keep_freed_memory`). It is what `MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=...` does from the environment, and why PyTorch's CPU tuning guides suggest
jemalloc or tcmalloc.

It fails at long completions: when a step's activations are tens of MB each, blocks freed between
layers are not reused whole (the next layer's live outputs pin the heap above them), and the heap grows
layer after layer. `configure_allocator` therefore keeps freed memory only while the step's largest
activation is below `KEEP_BELOW` (glibc's own ceiling for heap-served blocks); above it, blocks of
`MMAP_FROM` or more are mapped and returned on free, on transparent huge pages when `GLIBC_TUNABLES=
glibc.malloc.hugetlb=1` was set at process start (the CLI sets it), which makes their page faults cheap.
Measurements: docs/performance.md (long completions).
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
KEEP_UP_TO = 2**31 - 1  # bytes of freed heap kept before trimming (mallopt takes an int)


def keep_freed_memory() -> bool:
    """Ask glibc to serve large allocations from the heap and keep what is freed; False where there is no
    glibc (macOS, musl), which changes nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO))


M_MMAP_THRESHOLD = -3
KEEP_BELOW = 32 * 2**20  # glibc's default ceiling for its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_FROM = 4 * 2**20  # with large activations: blocks from this size are mapped, and unmapped when freed
MMAP_MAX_DEFAULT = 65536  # glibc's default count of mapped blocks (keep_freed_memory sets 0)
TRIM_ABOVE = 256 * 2**20  # ... and the heap (smaller blocks) keeps at most this much freed memory at its top


def configure_allocator(largest_activation_bytes: float) -> str:
    """`keep` (keep_freed_memory) for steps whose activations are all below KEEP_BELOW, else `bounded`; `default`
    where there is no glibc. Returns the mode chosen."""
    if largest_activation_bytes < KEEP_BELOW:
        return "keep" if keep_freed_memory() else "default"
    if not sys.platform.startswith("linux"):
        return "default"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "default"
    ok = all(mallopt(option, value) for option, value in
             ((M_MMAP_MAX, MMAP_MAX_DEFAULT), (M_MMAP_THRESHOLD, MMAP_FROM), (M_TRIM_THRESHOLD, TRIM_ABOVE)))
    return "bounded" if ok else "default"
