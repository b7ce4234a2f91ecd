"""Every GPU kernel of a step traced by train_gpt2.py --profile_step, summed by name and by the compiled graph (or
eager op) that launched it, forward or backward: the whole list, where the profile's kernel table stops at 60 rows.

    python -m dev.kernel_table RUN_DIR/profile_stepN.json > kernels.txt

Columns: total ms, launches, mean us per launch, F(orward) or B(ackward) (an autograd backward op was open at the
launch), the launching graph (16 characters of its hash, or the innermost eager op), the kernel (150 characters).
Rows under 0.2 ms are left out.
"""
import sys
from collections import defaultdict

from runtime.errors import exit_on_user_error
from runtime.profile import COMPILED_GRAPH, launch_sites, read_gpu_trace


def main():
    events = read_gpu_trace(sys.argv[1:], "python -m dev.kernel_table")
    rows = defaultdict(lambda: [0, 0.0])
    for (path, name), (count, ms) in launch_sites(events).items():
        graph = next((op[len(COMPILED_GRAPH) + 1:][:16] for op in path if op.startswith(COMPILED_GRAPH)),
                     path[-1][:30])
        side = "B" if any("Backward" in op for op in path) else "F"
        row = rows[side, graph, name[:150]]
        row[0] += count
        row[1] += ms
    print(f"total {sum(ms for _, ms in rows.values()):.2f} ms")
    for (side, graph, name), (count, ms) in sorted(rows.items(), key=lambda item: -item[1][1]):
        if ms >= 0.2:
            print(f"{ms:8.2f} {count:5d} {1e3 * ms / count:8.1f}us {side} {graph:16s} {name}")


if __name__ == "__main__":
    exit_on_user_error(main)
