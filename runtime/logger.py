"""Run logging, rank 0 only: a text log, a JSONL metrics file, a progress bar.

The text log opens with the config, the versions and the run's source, so a log alone tells what ran; step lines keep
the speedrun's format (`step:N/T train_loss:X train_time:Yms step_avg:Zms`) for existing parsers."""
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from runtime.run import write_failed

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("model", "optim", "data", "runtime", "evals")  # with train_gpt2.py: all code a run executes


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()


def versions(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    # a copy of the code (a container) names its commit; it wins over the HEAD of a checkout it may sit in
    if named := os.environ.get("SPEEDRUN_GIT_COMMIT"):
        info["git_commit"] = named
        return info
    try:
        commit = _git("rev-parse", "HEAD")
        # edits to the run's code make the commit name only where the code started
        changed = _git("status", "--porcelain", "--", "train_gpt2.py", *SOURCE_DIRS) if len(commit) == 40 else ""
    except OSError:  # no git on the machine
        commit, changed = "", ""
    if len(commit) == 40:
        info["git_commit"], info["git_code_changed"] = commit, bool(changed)
    else:  # no git, or a .git of HEAD and refs alone (the Docker image)
        info["git_commit"], info["git_code_changed"] = head_commit(REPO / ".git"), None
    return info


def head_commit(git_dir: Path) -> str | None:
    """The commit HEAD names, read from `git_dir`'s files without git; None when they do not say."""
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            commit = head  # detached
        elif (git_dir / head[5:]).is_file():
            commit = (git_dir / head[5:]).read_text().strip()
        else:  # packed by git gc: "<commit> <ref>" lines
            packed = (git_dir / "packed-refs").read_text().splitlines()
            commit = next((line.split()[0] for line in packed if line.split()[1:] == [head[5:]]), "")
    except OSError:
        return None
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def source_files() -> list[Path]:
    files = [REPO / "train_gpt2.py"]
    for d in SOURCE_DIRS:
        files += sorted((REPO / d).rglob("*.py"))
    return files


class RunLog:
    """Writes the text log and metrics under `run_dir` and draws the bar; a no-op on ranks > 0. `notes` (from before
    the log existed) are printed after the header."""

    def __init__(self, run_dir: Path | None, total_steps: int, tokens_per_step: int, enabled: bool,
                 notes: list[str] | None = None):
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.total_steps, self.notes = total_steps, notes or []
        # unbuffered, so a failed write leaves nothing to fail again at close
        self.text = open(self.run_dir / "log.txt", "ab", buffering=0)
        self.metrics = open(self.run_dir / "metrics.jsonl", "ab", buffering=0)
        self.last_step, self.step_bytes = 0, 0  # the latest step logged, and bytes per step
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not sys.stderr.isatty())

    def header(self, config, model_config, device: torch.device) -> None:
        if not self.enabled:
            return
        lines = [f"config: {json.dumps(dataclasses.asdict(config))}",
                 f"model_config: {json.dumps(dataclasses.asdict(model_config))}",
                 f"versions: {json.dumps(versions(device))}",
                 *(f"===== {path.relative_to(REPO)} =====\n{path.read_text()}" for path in source_files()),
                 "=" * 40 + " run " + "=" * 40]
        self._write_text("\n".join(lines))  # one write, so a failure reports all the space it needs
        for note in self.notes:
            self.print(note)

    def print(self, line: str) -> None:
        """A line on the console (above the bar) and in the text log."""
        if not self.enabled:
            return
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
        self._write_text(line)

    def step(self, step: int, total: int, train_time_ms: float, train_loss: float | None = None,
             val_loss: float | None = None, val_time_s: float | None = None) -> None:
        """One speedrun-format line and one JSONL record; advances the bar. Validation time is not train time."""
        if not self.enabled:
            return
        avg = train_time_ms / max(step, 1)
        kind, loss = ("val_loss", val_loss) if val_loss is not None else ("train_loss", train_loss)
        line = f"step:{step}/{total} {kind}:{loss:.4f} train_time:{train_time_ms:.0f}ms step_avg:{avg:.2f}ms"
        record = {"step": step, kind: loss, "train_time_ms": round(train_time_ms, 3), "step_avg_ms": round(avg, 3)}
        if val_time_s is not None:
            line += f" val_time:{val_time_s:.2f}s"
            record["val_time_s"] = round(val_time_s, 3)
        record_line = json.dumps(record) + "\n"
        if step > self.last_step:
            self.step_bytes = (len(line) + 1 + len(record_line)) / (step - self.last_step)
            self.last_step = step
        self.print(line)
        self._append(self.metrics, record_line)
        if kind == "train_loss":
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"loss {loss:.3f} | {self.tokens_per_step / max(avg, 1e-9) * 1e3:,.0f} tok/s")
        self.bar.refresh()

    def _write_text(self, line: str) -> None:
        self._append(self.text, line + "\n")

    def _append(self, file, text: str) -> None:
        """Append all of `text` to `file`; a failed write stops the run with the space the rest of the log needs."""
        data = text.encode()
        try:
            while data:
                data = data[file.write(data):]  # a write may be partial
        except OSError as e:
            rest = len(data) + self.step_bytes * (self.total_steps - self.last_step)
            raise write_failed(f"the log {file.name}", self.run_dir, e, rest) from None

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.text.close()
            self.metrics.close()
