"""glibc's allocator, set for CPU runs that run.sh did not start (`python train_gpt2.py --preset smoke`).

On the CPU the head's (tokens x 50,304) fp32 tensors are larger than glibc's largest mmap threshold, so each one is
mapped and unmapped every step, and the kernel zeroes its pages again at each first touch. run.sh keeps them in the
heap with GLIBC_TUNABLES (run.sh says what each setting does and what it costs). Tunables must be in the environment
when the process starts; mallopt sets the same two from inside it."""
import ctypes
import os

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # run.sh's glibc.malloc.trim_threshold: up to 1 GiB stays free at the heap's top


def keep_freed_memory() -> bool:
    """Every block from the heap (no mmap), freed memory kept for the next step, as run.sh's tunables ask. On a 2-core
    AMD EPYC `python train_gpt2.py --preset smoke` took 60.6-61.6 s without them, 28.3-28.6 s with these two, and
    27.9-30.2 s with huge pages as well (bench/results/README.md), the same losses each time. Returns whether it set
    them: not where GLIBC_TUNABLES already names a malloc setting (run.sh's, or the user's own, which must win), nor
    where the C library has no mallopt."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library other than glibc, e.g. musl
        return False
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
