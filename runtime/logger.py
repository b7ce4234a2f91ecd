"""Run logging, rank 0 only: one fixed-format text log, one JSONL metrics file, one progress bar.

The text log opens with the config, the versions and the source of the run's code, so a log alone tells
what ran; the step lines keep the speedrun's format (`step:N/T train_loss:X train_time:Yms step_avg:Zms`)
so existing log parsers work. `metrics.jsonl` holds the same numbers for plots and benchmarks.
"""
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("model", "optim", "data", "runtime")  # with train_gpt2.py: all code a training run executes


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()


def versions(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    # A copy of the code (a container, an exported tree) says where it came from with SPEEDRUN_GIT_COMMIT; it wins
    # over git, because a copy placed inside another checkout would otherwise report that checkout's HEAD.
    if named := os.environ.get("SPEEDRUN_GIT_COMMIT"):
        info["git_commit"] = named
        return info
    try:
        commit = _git("rev-parse", "HEAD")
        # the code a run executes, changed against that commit: a working tree with edits, or a copy of one that
        # kept an older .git (as the GPU machine's copies do); the commit then names only where the code started
        changed = _git("status", "--porcelain", "--", "train_gpt2.py", *SOURCE_DIRS) if len(commit) == 40 else ""
    except OSError:  # no git on the machine: the logged source below still says what ran
        commit, changed = "", ""
    info["git_commit"] = commit if len(commit) == 40 else None
    info["git_code_changed"] = bool(changed) if info["git_commit"] else None
    return info


def source_files() -> list[Path]:
    files = [REPO / "train_gpt2.py"]
    for d in SOURCE_DIRS:
        files += sorted((REPO / d).glob("*.py"))
    return files


class RunLog:
    """Writes under `run_dir` (text log, metrics) and draws the console bar; a no-op on ranks > 0."""

    def __init__(self, run_dir: Path | None, total_steps: int, tokens_per_step: int, enabled: bool):
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.text = open(self.run_dir / "log.txt", "a", buffering=1)
        self.metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not sys.stderr.isatty())

    def header(self, config, model_config, device: torch.device) -> None:
        if not self.enabled:
            return
        self._write_text("config: " + json.dumps(dataclasses.asdict(config)))
        self._write_text("model_config: " + json.dumps(dataclasses.asdict(model_config)))
        self._write_text("versions: " + json.dumps(versions(device)))
        for path in source_files():
            self.text.write(f"===== {path.relative_to(REPO)} =====\n{path.read_text()}\n")
        self.text.write("=" * 40 + " run " + "=" * 40 + "\n")

    def print(self, line: str) -> None:
        """A line on the console (above the bar) and in the text log."""
        if not self.enabled:
            return
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
        self._write_text(line)

    def step(self, step: int, total: int, train_time_ms: float, train_loss: float | None = None,
             val_loss: float | None = None, val_time_s: float | None = None) -> None:
        """One speedrun-format line plus one JSONL record; advances the bar to `step`. A validation's wall time
        is not in train_time (the clock pauses for it), so it gets its own field."""
        if not self.enabled:
            return
        avg = train_time_ms / max(step, 1)
        kind, loss = ("val_loss", val_loss) if val_loss is not None else ("train_loss", train_loss)
        line = f"step:{step}/{total} {kind}:{loss:.4f} train_time:{train_time_ms:.0f}ms step_avg:{avg:.2f}ms"
        record = {"step": step, kind: loss, "train_time_ms": round(train_time_ms, 3), "step_avg_ms": round(avg, 3)}
        if val_time_s is not None:
            line += f" val_time:{val_time_s:.2f}s"
            record["val_time_s"] = round(val_time_s, 3)
        self.print(line)
        self.metrics.write(json.dumps(record) + "\n")
        if kind == "train_loss":
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"loss {loss:.3f} | {self.tokens_per_step / max(avg, 1e-9) * 1e3:,.0f} tok/s")
        self.bar.refresh()

    def _write_text(self, line: str) -> None:
        self.text.write(line + "\n")

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.text.close()
            self.metrics.close()
