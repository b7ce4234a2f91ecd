"""CPU memory: glibc's allocator settings for runs not started by run.sh, and the check that a CPU run fits."""
import ctypes
import os
from pathlib import Path

from model.config import GPTConfig
from runtime.errors import UserError

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # run.sh's glibc.malloc.trim_threshold
GiB = 2 ** 30
PARAMETER_COPIES = 5  # fp32: weights, gradients, two optimizer moments, the warm-up's copy
HEAD_COPIES = 7  # (tokens x vocab) fp32 tensors alive at the head's backward
PROCESS_BYTES = GiB // 2  # torch itself, before the model
MARGIN = 1.15  # allocator slack


def keep_freed_memory() -> bool:
    """Allocate from the heap and keep freed memory, as run.sh's GLIBC_TUNABLES do: else the head's large tensors are
    mapped and zeroed anew every step. Returns whether it did (not if GLIBC_TUNABLES sets malloc: the user's wins)."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc, e.g. musl
        return False
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def num_params(c: GPTConfig) -> int:
    """The parameters of model/gpt.py's GPT for config c."""
    A, D, F = c.num_heads * c.head_dim, c.model_dim, c.mlp_ratio * c.model_dim
    attention = 4 * A * D + 3 + c.num_heads * max(1, D // 64)
    blocks = sum(2 + attention * (i not in c.no_attention_layers) + 2 * D * F * (i not in c.no_mlp_layers)
                 for i in range(c.num_layers))
    return c.vocab_size * (2 * D + c.num_value_embeds * A) + blocks + c.num_layers // 2 + int(c.backout)


def cpu_bytes(c: GPTConfig, device_batch_size: int, seq_len: int) -> int:
    """An upper estimate of one CPU training process's peak memory (fp32, SDPA with an explicit (T x T) mask)."""
    B, T, N = device_batch_size, seq_len, device_batch_size * seq_len
    A, D, F = c.num_heads * c.head_dim, c.model_dim, c.mlp_ratio * c.model_dim
    per_token = sum(4 * D + 12 * A * (i not in c.no_attention_layers) + 3 * F * (i not in c.no_mlp_layers)
                    for i in range(c.num_layers))
    scores = (c.num_layers - len(c.no_attention_layers)) * (2 * B * c.num_heads * T * T * 4 + 4 * B * T * T)
    head = HEAD_COPIES * N * c.vocab_size * 4
    total = PARAMETER_COPIES * 4 * num_params(c) + 4 * N * per_token + scores + head + PROCESS_BYTES
    return int(MARGIN * total)


def available_bytes() -> int | None:
    """MemAvailable, bounded by the cgroup's limit if set."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_cpu_memory(c: GPTConfig, device_batch_size: int, seq_len: int, batch_size: int, processes: int) -> None:
    """A UserError, naming flags that fit, where `processes` such CPU processes exceed the available memory."""
    available = available_bytes()
    if available is None:
        return
    need = processes * cpu_bytes(c, device_batch_size, seq_len)
    if need <= available:
        return
    fits = ""
    d, t, b = device_batch_size, seq_len, batch_size
    while t >= 256 and not fits:
        if d > 1:
            d //= 2
        else:  # the same tokens per step, in shorter sequences
            t, b = max(128, t // 256 * 128), b * 2
        if processes * cpu_bytes(c, d, t) <= available:
            fits = f"--device_batch_size={d} --seq_len={t} --batch_size={b} fits; or "
    raise UserError(f"this CPU run needs about {need / GiB:.1f} GiB of memory ({processes} process(es): weights, "
                    f"optimizer state and one micro-batch of {device_batch_size * seq_len:,} tokens) and "
                    f"{available / GiB:.1f} GiB are available: {fits}train a small model with --preset smoke (the "
                    f"sample corpus) or --preset tiny (your own shards)")
