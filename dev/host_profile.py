"""Where the host's time goes in the timed steps of a GPU run, from a py-spy recording of a bench.run throughput run
(speedscope format): whether the host keeps ahead of the GPU, and which of our code costs it time.

    py-spy record --nonblocking --idle --threads --subprocesses -r 100 -f speedscope -o host.json -- \\
        python3 -m bench.run throughput --data /tmp/proxy --out X.json --steps 60
    python -m dev.host_profile host.json > host_profile.txt

Why: the profiler's own host work lengthens a traced step, so a trace cannot say how close the host runs to the
GPU in an untraced one. py-spy samples the host from outside, at a small cost to the step. bench.run throughput logs
every step, and the main thread reads each step's loss once the next step is queued (runtime.control.LossRecord.read):
its seconds there are the GPU's lead over the host; near zero, the host is less than a step ahead, and may be what
limits the step (the recording cannot say whether the GPU idled).

Only the timed steps count: from the end of the main thread's first validation (step 0's) to the start of its last
(after the last step; bench.run throughput validates at these two only). With --idle, py-spy samples every thread at
every tick, so a thread's samples, counted back from the end of the recording, give their time, and the same window
applies to the threads that live to the end (the autograd engine's device thread, which runs the backward on a GPU). For
each thread with any frame of our code in the window: its seconds there, then two tables. By where each sample is: the
innermost frame of our code and the frame below it ("none": no Python frame below, as in a GPU sync, which spins, or a
kernel launch's C half). By each function of our code, inclusive. A thread's samples with no Python frame at all (idle)
count in its seconds only.
py-spy is not a dependency: its wheel holds one static binary (dev/cold_profile.py).
"""
import collections
from pathlib import Path

from dev.cold_profile import recording_cli

ROWS = 25
VALIDATE = "train.<locals>.validate"  # train_gpt2.py's


def ours(frame: dict, repo: str) -> bool:
    file = frame.get("file", "")
    return file.startswith(repo) and "/site-packages/" not in file  # a virtual environment may lie in the checkout


def name(frame: dict, repo: str, line: bool = True) -> str:
    """function (file:line): files of ours from the checkout, installed ones from their package's folder."""
    file = frame.get("file", "?")
    file = (file[len(repo):] if ours(frame, repo) else file.split("/site-packages/")[-1] if "/site-packages/" in file
            else Path(file).name)
    return f"{frame['name']} ({file}:{frame.get('line')})" if line else f"{frame['name']} ({file})"


def timed_window(profile: dict, frames: list[dict]) -> tuple[float, float]:
    """(start, end) of the timed steps in seconds before the recording's end: from the end of the main thread's
    first stretch of samples in train()'s validate() to the start of its last."""
    stretches, inside = [], False
    for index, stack in enumerate(profile["samples"]):
        validating = any(frames[i]["name"] == VALIDATE for i in stack)
        if validating and not inside:
            stretches.append([index, index])
        if validating:
            stretches[-1][1] = index
        inside = validating
    if len(stretches) < 2:
        raise ValueError("the main thread ran validate() fewer than twice (step 0's and the last step's)")
    before_end = _before_end(profile["weights"])
    return before_end[stretches[0][1]] - profile["weights"][stretches[0][1]], before_end[stretches[-1][0]]


def _before_end(weights: list[float]) -> list[float]:
    """Each sample's start in seconds before the end of the thread's samples."""
    total, at, starts = sum(weights), 0.0, []
    for w in weights:
        starts.append(total - at)
        at += w
    return starts


def thread_tables(profile: dict, frames: list[dict], repo: str, window: tuple[float, float] = (float("inf"), 0.0)
                  ) -> tuple[float, float, collections.Counter, collections.Counter]:
    """(seconds in the window, seconds of them in Python, seconds by (innermost frame of ours, the frame below it),
    inclusive seconds by our functions), the window as timed_window gives it. In Python: any frame with a file
    (py-spy's process and thread frames have none), so a thread's other seconds are idle or in native code alone,
    as the autograd thread is between the backward's ops. Samples without a frame of ours count in the first two
    only."""
    sampled, python, where, inclusive = 0.0, 0.0, collections.Counter(), collections.Counter()
    for stack, seconds, start in zip(profile["samples"], profile["weights"], _before_end(profile["weights"])):
        if not window[0] >= start > window[1]:
            continue
        sampled += seconds
        python += seconds if any(frames[i].get("file") for i in stack) else 0.0
        at = [j for j, i in enumerate(stack) if ours(frames[i], repo)]
        if not at:
            continue
        below = name(frames[stack[at[-1] + 1]], repo) if at[-1] + 1 < len(stack) else "none"
        where[(name(frames[stack[at[-1]]], repo), below)] += seconds
        for function in {name(frames[stack[j]], repo, line=False) for j in at}:
            inclusive[function] += seconds
    return sampled, python, where, inclusive


def main():
    ap, args, frames, profiles = recording_cli(__doc__)
    main_thread = next((p for p in profiles if any(frames[i]["name"] == VALIDATE for s in p["samples"] for i in s)),
                       None)
    if main_thread is None:
        ap.error(f"no thread in {args.speedscope} ran train_gpt2's validate(): record the whole run, with py-spy's "
                 f"--subprocesses, as above")
    try:
        window = timed_window(main_thread, frames)
    except ValueError as error:
        ap.error(f"{args.speedscope}: {error}")
    print(f"the timed steps: {window[0] - window[1]:.2f} s, from {window[0]:.2f} to {window[1]:.2f} s before the "
          f"recording's end")
    # with --subprocesses, py-spy names each thread "Process PID Thread TID": keep the training process's
    process = main_thread["name"].split()[:2] if main_thread["name"].startswith("Process ") else []
    for p in profiles:
        if p["name"].split()[:len(process)] != process:
            continue
        sampled, python, where, inclusive = thread_tables(p, frames, args.repo, window)
        if not where:
            continue
        print(f"{p['name']}: {sampled:.2f} s sampled in the timed steps, {python:.2f} s of them in Python")
        print("  seconds  share  innermost frame of our code -> the frame below it")
        for (inner, below), seconds in where.most_common(ROWS):
            print(f"  {seconds:7.2f}  {seconds / sampled:5.1%}  {inner} -> {below}")
        print("  seconds  share  our functions, inclusive")
        for function, seconds in inclusive.most_common(ROWS):
            print(f"  {seconds:7.2f}  {seconds / sampled:5.1%}  {function}")


if __name__ == "__main__":
    main()
