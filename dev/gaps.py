"""Where the GPU waits in a step traced by train_gpt2.py --profile_step: the gaps between one piece of GPU work and
the next, by size, and summed by the code that launched the work after the gap.

    python -m dev.gaps RUN_DIR/profile_stepN.json > gaps.txt

Each site row gives the mean time from the launch of the work after the gap to its start. A few microseconds: the
GPU had run out of queued work and waited for that launch (the host is too slow there, e.g. eager ops of a few
microseconds each). Many milliseconds: the work was queued long before, and the gap is the GPU's own (a copy
engine, or the profiler).
"""
import sys
from collections import defaultdict

from runtime.errors import exit_on_user_error
from runtime.profile import GPU_WORK, LAUNCHES, launch_paths, read_gpu_trace

MIN_GAP_US = 2  # shorter gaps are the usual distance between back-to-back kernels
BUCKETS_US = (5, 20, 100, 1000, float("inf"))
SITES = 40


def main():
    events = read_gpu_trace(sys.argv[1:], "python -m dev.gaps")
    path_of = launch_paths(events)
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    work = sorted((e for e in events if e.get("cat") in GPU_WORK and "dur" in e), key=lambda e: e["ts"])
    end, before = work[0]["ts"] + work[0]["dur"], work[0]
    sites = defaultdict(lambda: [0, 0.0, 0.0])  # (launching ops, next, previous) -> [gaps, ms, summed lag us]
    buckets = defaultdict(lambda: [0, 0.0])
    for e in work[1:]:
        gap = e["ts"] - end
        if gap > MIN_GAP_US:
            corr = e.get("args", {}).get("correlation")
            path = path_of.get(corr, ("(launch not traced)",))
            site = sites[" > ".join(path[-3:]), e["name"][:50], before["name"][:40]]
            site[0] += 1
            site[1] += gap / 1e3
            site[2] += e["ts"] - launched_at.get(corr, e["ts"])
            bucket = buckets[next(b for b in BUCKETS_US if gap < b)]
            bucket[0] += 1
            bucket[1] += gap / 1e3
        if e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e
    count, ms = sum(n for n, _ in buckets.values()), sum(t for _, t in buckets.values())
    print(f"span {(end - work[0]['ts']) / 1e3:.1f} ms, gaps > {MIN_GAP_US} us: {count}, {ms:.2f} ms")
    for bound in sorted(buckets):
        print(f"  gaps below {bound} us: {buckets[bound][0]} totalling {buckets[bound][1]:.2f} ms")
    print("top gap sites (ms, gaps, mean launch-to-start us | CPU ops that launched the next work | next | previous)")
    for (path, after, before_name), (n, gap_ms, lag) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:SITES]:
        print(f"{gap_ms:7.2f} {n:5d} {lag / n:8.1f} | {path} | {after} | {before_name}")


if __name__ == "__main__":
    exit_on_user_error(main)
