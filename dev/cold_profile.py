"""Where a cold start's seconds go, from a py-spy recording of a bench.run throughput run (speedscope format).

    py-spy record --nonblocking --idle --threads --subprocesses -r 50 -f speedscope -o cold.json -- \\
        python -m bench.run throughput --data /tmp/proxy --out X.json --steps 27
    python -m dev.cold_profile cold.json > cold_profile.txt

py-spy is not a dependency: its wheel holds one static binary, carried to the GPU machine. For the training
process's main thread and its autograd thread (which runs the backward, and so compiles the backward graphs), each
row is the seconds of samples whose stack holds that frame; rows overlap (a compile inside a step counts in both).
Then the compile seconds of each thread by the line of our code that called the compiled function (dynamo's
_compile, and the autograd thread's backward compile) and train_gpt2.py's line that led there, and for inductor's
compile workers, the seconds they spent compiling Triton kernels and the longest single stretch.
"""
import argparse
import collections
import json
from pathlib import Path

# (label, frame name) in the order of a run
FRAMES = [
    ("imports: Python source compiled to bytecode (no .pyc on disk)", "SourceLoader.source_to_code"),
    ("training steps (warm-up and timed)", "train.<locals>.train_step"),
    ("dynamo: frames traced and compiled (inclusive)", "_compile"),
    ("inductor: forward graphs", "compile_fx_forward"),
    ("inductor: backward graphs", "compile_fx_backward"),
    ("inductor: graphs without autograd (optimizer, validation)", "aot_stage2_inference"),
    ("the optimizer's first step (inclusive)", "MuonAdam.step"),
    ("waiting for the compile workers' Triton kernels", "AsyncCompile.wait"),
    ("inductor benchmarking a kernel's configurations", "CachingAutotuner.benchmark_all_configs"),
    ("Triton building a C launcher with the host compiler", "compile_module_from_src"),
    ("Triton compiling a kernel in this thread (ours, on first launch)", "JITFunction._do_compile"),
]


def thread_rows(profile: dict, frames: list[dict]) -> dict[str, float]:
    totals = collections.Counter()
    for stack, seconds in zip(profile["samples"], profile["weights"]):
        names = {frames[i]["name"] for i in stack}
        totals["sampled"] += seconds
        for label, frame in FRAMES:
            if frame in names:
                totals[label] += seconds
    return totals


def where(frame: dict, repo: str) -> str:
    return f"{frame['name']} ({frame['file'][len(repo):]}:{frame.get('line')})"


def compile_callers(profile: dict, frames: list[dict], repo: str) -> collections.Counter:
    """Compile seconds by (compile frame, the innermost frame of our code above it)."""
    callers = collections.Counter()
    for stack, seconds in zip(profile["samples"], profile["weights"]):
        names = [frames[i]["name"] for i in stack]
        at = next((j for j, n in enumerate(names) if n in ("_compile", "compile_fx_backward")), None)
        if at is None:
            continue
        ours = [frames[i] for i in stack[:at] if frames[i].get("file", "").startswith(repo)]
        caller = where(ours[-1], repo) if ours else "-"
        # the trainer's own line tells a training step's compile from the validation batch's
        trainer = [f for f in ours if f["file"].endswith("/train_gpt2.py")]
        if trainer and trainer[-1] is not ours[-1]:
            caller += f" in {where(trainer[-1], repo)}"
        callers[(names[at], caller)] += seconds
    return callers


def worker_rows(profile: dict, frames: list[dict]) -> tuple[float, float]:
    """(seconds inside _worker_compile_triton, longest stretch of consecutive such samples)."""
    busy = longest = stretch = 0.0
    for stack, seconds in zip(profile["samples"], profile["weights"]):
        if any(frames[i]["name"] == "_worker_compile_triton" for i in stack):
            busy += seconds
            stretch += seconds
            longest = max(longest, stretch)
        else:
            stretch = 0.0
    return busy, longest


def read_recording(path: str, ap: argparse.ArgumentParser) -> tuple[list[dict], list[dict]]:
    """(frames, profiles: one per thread) of a py-spy recording; a file of another kind ends in ap.error."""
    try:
        data = json.loads(Path(path).read_bytes())
        return data["shared"]["frames"], data["profiles"]
    except OSError as error:
        ap.error(f"{path}: {error.strerror}")
    except (ValueError, KeyError, TypeError):  # not JSON, or JSON of another kind (a Chrome trace)
        ap.error(f"{path} is not a py-spy recording in speedscope format (-f speedscope)")


def recording_cli(doc: str) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[dict], list[dict]]:
    """The command line of the py-spy readers (a recording, --repo), parsed, and the recording's frames and
    profiles."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("speedscope")
    ap.add_argument("--repo", default=f"{Path(__file__).resolve().parents[1]}/",
                    help="the checkout's path on the machine that recorded it (default: this checkout's)")
    args = ap.parse_args()
    return ap, args, *read_recording(args.speedscope, ap)


def main():
    ap, args, frames, profiles = recording_cli(__doc__)
    # the training process is the one whose main thread runs train_gpt2.py
    trainer = next((p["name"].split()[1] for p in profiles
                    if any(frames[i]["name"] == "train" for s in p["samples"][:2000] for i in s)), None)
    if trainer is None:
        ap.error(f"no process in {args.speedscope} ran train_gpt2's train(): record with py-spy's --subprocesses, "
                 f"as above")
    busy_total, longest_job, workers = 0.0, 0.0, 0
    for p in profiles:
        pid = p["name"].split()[1]
        if pid == trainer:
            rows = thread_rows(p, frames)
            if len(rows) > 1:  # threads that did any of the above: the main thread and autograd's
                print(f"{p['name']}: {rows.pop('sampled'):.1f} s sampled")
                for label, _ in FRAMES:
                    if rows[label]:
                        print(f"  {rows[label]:6.1f} s  {label}")
                for (frame, caller), seconds in compile_callers(p, frames, args.repo).most_common():
                    print(f"  {seconds:6.1f} s  compiling ({frame}), called from {caller}")
        else:
            busy, longest = worker_rows(p, frames)
            if busy:
                workers += 1
                busy_total += busy
                longest_job = max(longest_job, longest)
    print(f"compile workers: {workers} compiled Triton kernels for {busy_total:.1f} s in all; "
          f"longest unbroken stretch {longest_job:.1f} s")


if __name__ == "__main__":
    main()
