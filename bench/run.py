"""Benchmark harness: runs train_gpt2.py as a user would and turns its logs into one JSON per run.

    python -m bench.run throughput --data /tmp/proxy --out bench/results/throughput.json
    python -m bench.run speedrun   --data /tmp/proxy --out bench/results/speedrun.json -- --num_iterations=300
    python -m bench.run throughput --nproc 2 ...        # torchrun on 2 GPUs

Everything is measured by the training script itself (its metrics.jsonl and log.txt), so a benchmark figure is
exactly what a user's run would show. Modes (BENCHMARKS.md):
- throughput: the record config at a fixed attention window of 896 tokens, validation off, one line per step;
  ms/step is the median of per-step times after the first SKIP steps, with the spread around it.
- speedrun: any train_gpt2.py arguments; records the (step, val loss, train time) rows.
Both record the cold start: seconds from launch to the end of the compile warm-up, and whether it was strictly
cold (no files in the compile caches when the run started); and the clocks, power and temperature of the GPUs it
uses from the end of the warm-up to the last step (bench/gpu_monitor.py).

Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE), the harness first does what run.sh does: it writes
the packages' bytecode into PYTHONPYCACHEPREFIX's folder (runtime/bytecode.py), and counts those seconds in the
cold start (cold_start_s). --as_image leaves that out, to measure Python as the machine's image has it.
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_monitor import GpuMonitor, run_gpus
from model.config import GPTConfig, flops_per_token
from runtime.bytecode import cache_prefix

REPO = Path(__file__).resolve().parent.parent
SKIP = 5  # steps after warm-up left out of the median: the allocator and clocks are still settling
TIMED = 20  # BENCHMARKS.md: the median of at least 20 steps after warm-up
MIN_STEPS = SKIP + TIMED + 2  # the first step has no predecessor line, and one may be profiled
BYTECODE_NOTE = "Python compiles torch's sources at every start"  # in the trainer's note (runtime.bytecode)
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, NVIDIA datasheet (the two share the chip)


def bytecode_step(env: dict, console: Path, names: tuple[str, ...] = ()) -> dict:
    """run.sh's step before the training where Python may not write bytecode: the packages' bytecode written into
    PYTHONPYCACHEPREFIX's folder (set in `env`, as run.sh exports it), timed; its message goes to the console log."""
    env["PYTHONPYCACHEPREFIX"] = cache_prefix(env)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runtime.bytecode", *names], cwd=REPO, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    with open(console, "a") as out:  # main() empties it before this step or the launch writes to it
        out.write(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"python -m runtime.bytecode failed with status {proc.returncode}; see {console}")
    written = re.search(r"bytecode: ([\d,]+) Python files", proc.stderr)
    return {"ran": True, "prefix": env["PYTHONPYCACHEPREFIX"], "seconds": round(seconds, 1),
            "files_written": int(written.group(1).replace(",", "")) if written else 0}


def launch(nproc: int, train_args: list[str], log_dir: Path, console: Path,
           env: dict) -> tuple[float, float | None, float | None]:
    """Run train_gpt2.py; returns (wall seconds, seconds until the warm-up line appeared, seconds until the last step's
    line appeared, train or validation)."""
    if nproc > 1:
        cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "train_gpt2.py"]
    else:
        cmd = [sys.executable, "train_gpt2.py"]
    cmd += train_args + [f"--log_dir={log_dir}"]
    t0, warm, last_step = time.perf_counter(), None, None
    with open(console, "a") as out:  # after the bytecode step's lines
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**env, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            out.write(line)
            out.flush()  # a run killed by a time limit still leaves its log
            if warm is None and line.startswith("warm-up:"):
                warm = time.perf_counter() - t0
            if line.startswith("step:"):
                last_step = time.perf_counter() - t0
        if proc.wait():
            error = next((line for line in console.read_text().splitlines() if line.startswith("error: ")), None)
            sys.exit(f"train_gpt2.py failed with status {proc.returncode}" + (f" ({error})" if error else "") +
                     f"; see {console}")
    return time.perf_counter() - t0, warm, last_step


def val_context(lines: list[str]) -> int:
    """The tokens of context each validation sequence repeated (train_gpt2's --val_context, resolved); 0 when the
    run folder line does not say (runs before the option cut validation into consecutive sequences)."""
    found = (re.search(r"\((\d+) tokens of context per sequence\)", line) for line in lines)
    return next((int(m.group(1)) for m in found if m), 0)


def read_run(log_dir: Path) -> tuple[dict, list[dict], list[str]]:
    (run_dir,) = [Path(p) for p in glob.glob(str(log_dir / "*")) if Path(p).is_dir()]
    lines = (run_dir / "log.txt").read_text().splitlines()
    head = {k: json.loads(l.split(": ", 1)[1]) for l in lines for k in ("config", "versions", "model_config")
            if l.startswith(k + ": ")}
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return head, metrics, lines


def per_step_ms(metrics: list[dict], profiled_step: int = 0) -> list[float]:
    """Duration of each step from consecutive train-loss lines (step n's line comes after n steps), leaving out
    the step traced by --profile_step: the profiler slows it down."""
    train = [m for m in metrics if "train_loss" in m]
    return [b["train_time_ms"] - a["train_time_ms"] for a, b in zip(train, train[1:])
            if b["step"] == a["step"] + 1 and b["step"] != profiled_step]


def compile_cache_files() -> dict[str, int]:
    """{cache folder: files in it} for inductor's cache (compiled graphs and their kernels) and Triton's own (the
    head's hand-written kernels), read before the run starts: all 0 means the start was strictly cold."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    return {folder: sum(len(files) for _, _, files in os.walk(folder)) for folder in (cache_dir(), triton)}


def memory(lines: list[str]) -> dict:
    for line in lines:
        if line.startswith("peak memory allocated:"):
            words = line.split()
            return {"peak_allocated_gib": round(int(words[3]) / 1024, 2),
                    "peak_reserved_gib": round(int(words[6]) / 1024, 2)}
    return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["throughput", "speedrun"])
    ap.add_argument("--data", required=True, help="folder with fineweb_train_*.bin and fineweb_val_*.bin")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40, help=f"throughput: steps to run (>= {MIN_STEPS})")
    ap.add_argument("--as_image", action="store_true",
                    help="skip run.sh's bytecode step: where Python may not write bytecode and the packages have "
                         "none, every process then compiles torch's sources again")
    ap.add_argument("--keep", default="", help="copy the run folder (log, metrics, checkpoints, profiler trace) here; "
                                               "it is deleted otherwise")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # what follows `--` goes to train_gpt2.py as is
    args = ap.parse_args(argv[:split])
    args.train_args = argv[split + 1:]
    if args.mode == "throughput" and args.steps < MIN_STEPS:
        ap.error(f"--steps={args.steps} leaves fewer than {TIMED} timed steps after the first {SKIP}; "
                 f"use --steps={MIN_STEPS} or more")
    # Everything a finished run needs is checked now, not after minutes of training.
    if args.nproc < 1:
        ap.error(f"--nproc={args.nproc}: give the number of GPUs to run on, 1 or more")
    out = Path(args.out)
    if out.is_dir():
        ap.error(f"--out {out} is a folder: give a .json file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # the console log goes beside it from the first line
    except OSError as error:
        ap.error(f"--out {out}: cannot make its folder ({error.strerror})")
    if args.keep and Path(args.keep).exists() and not Path(args.keep).is_dir():
        ap.error(f"--keep {args.keep} is a file: give a folder for the run folder's copy")
    owned = ("--num_iterations", "--log_every", "--val_loss_every", "--window_min_tokens", "--window_max_tokens")
    if args.mode == "throughput" and (taken := [a for a in args.train_args if a.split("=")[0] in owned]):
        ap.error(f"throughput mode sets {', '.join(owned)} itself (--steps for the run's length); drop {taken[0]} "
                 f"after --, or use the speedrun mode")

    # absolute: train_gpt2.py runs in the repository, wherever this was started
    data_dir = Path(args.data).resolve()
    data = [f"--train_files={data_dir}/fineweb_train_*.bin", f"--val_files={data_dir}/fineweb_val_*.bin"]
    if args.mode == "throughput":
        mode_args = ["--window_min_tokens=896", "--window_max_tokens=896", f"--num_iterations={args.steps}",
                     "--val_loss_every=0", f"--val_tokens={args.nproc * 48 * 1024}", "--log_every=1"]
    else:
        mode_args = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp) / "logs"
        console = Path(args.out).with_suffix(".console.txt")
        console.write_text("")
        cached = compile_cache_files()
        env = dict(os.environ)
        if not env.get("PYTHONDONTWRITEBYTECODE"):
            bytecode = {"ran": False, "why": "Python writes bytecode as it imports (PYTHONDONTWRITEBYTECODE unset)"}
        elif args.as_image:
            bytecode = {"ran": False, "why": "--as_image"}
        else:
            bytecode = bytecode_step(env, console)
        with GpuMonitor(gpus=run_gpus(args.nproc)) as monitor:
            wall, warm, last_step = launch(args.nproc, data + mode_args + args.train_args, log_dir, console, env)
        head, metrics, lines = read_run(log_dir)
        for table in log_dir.glob("*/profile_step*.txt"):  # a --profile_step run's kernel table
            shutil.copy(table, Path(args.out).with_suffix(f".{table.stem}.txt"))
        if args.keep:
            shutil.copytree(log_dir, args.keep, dirs_exist_ok=True)

    cfg, mcfg = head["config"], head["model_config"]
    tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    result = {
        "mode": args.mode, "command": " ".join(sys.argv), "git_commit": head["versions"].get("git_commit"),
        "git_code_changed": head["versions"].get("git_code_changed"),
        "device": head["versions"].get("gpu", head["versions"]["device"]), "torch": head["versions"]["torch"],
        "world_size": args.nproc,
        "config": {"num_layers": mcfg["num_layers"], "model_dim": mcfg["model_dim"], "tokens_per_step": tokens_per_step,
                   # --device_batch_size=0: all of a process's sequences in one micro-step
                   "micro_steps": cfg["batch_size"] // ((cfg["device_batch_size"] or cfg["batch_size"] // args.nproc)
                                                        * args.nproc),
                   "seq_len": cfg["seq_len"], "window_tokens": [cfg["window_min_tokens"], cfg["window_max_tokens"]],
                   "compile": cfg["compile"], "val_context": val_context(lines)},
        "startup_to_warm_s": round(warm, 1) if warm else None, "wall_s": round(wall, 1),
        "cold_start_s": round(warm + bytecode.get("seconds", 0.0), 1) if warm else None, "bytecode_step": bytecode,
        "compile_cache_files_at_start": cached, "strictly_cold": not any(cached.values()),
        "torch_compiled_from_source_each_start": any(BYTECODE_NOTE in line for line in lines),
        "warmup_line": next((l for l in lines if l.startswith("warm-up:")), None), **memory(lines),
        "gpu_monitor": monitor.summary(since_s=warm or 0.0, until_s=last_step),  # the steps after the warm-up
    }
    if args.mode == "throughput":
        times = per_step_ms(metrics, profiled_step=cfg.get("profile_step", 0))[SKIP:]
        med = statistics.median(times)
        fpt = flops_per_token(GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in mcfg.items()}),
                              seq_len=cfg["seq_len"], window=cfg["window_max_tokens"])
        result.update({"steps_timed": len(times), "ms_per_step_median": round(med, 2),
                       "ms_per_step_min": round(min(times), 2), "ms_per_step_max": round(max(times), 2),
                       "ms_per_step_stdev": round(statistics.stdev(times), 2),
                       "tokens_per_s": round(tokens_per_step / med * 1e3),
                       "mfu": round(tokens_per_step / med * 1e3 * fpt / (PEAK_BF16_FLOPS * args.nproc), 4)})
    result["val_rows"] = [{"step": m["step"], "val_loss": m["val_loss"],
                           "train_time_s": round(m["train_time_ms"] / 1e3, 2), "val_wall_s": m["val_time_s"]}
                          for m in metrics if "val_loss" in m]
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
