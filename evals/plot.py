"""Loss curves of one or more runs: loss against steps and against training time, one colour per run.

    python -m evals.plot logs/RUN_A logs/RUN_B [--out loss.png] [--labels baseline "lr_hidden=0.02"]

Reads each run folder's metrics.jsonl (written by runtime/logger.py): validation loss as lines with markers,
training loss as faint lines. Needs matplotlib: pip install -e '.[plot]'.
"""
import argparse
import json
import sys
from pathlib import Path

from runtime.errors import UserError, exit_on_user_error


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """{"train_loss": [...], "val_loss": [...]}, each a list of (step, seconds of training, loss)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: pass run folders written by train_gpt2.py "
                        f"(the folders under its --log_dir)")
    curves = {"train_loss": [], "val_loss": []}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
            kind = next(k for k in curves if k in record)
            curves[kind].append((record["step"], record["train_time_ms"] / 1e3, record[kind]))
        except (json.JSONDecodeError, StopIteration, KeyError, TypeError):
            raise UserError(f"{path}:{lineno} is not a metrics record ({{\"step\", \"train_loss\" or "
                            f"\"val_loss\", \"train_time_ms\"}}); was the file written by train_gpt2.py?") from None
    if not any(curves.values()):
        raise UserError(f"{path} holds no losses yet: the run logs its first after step 0")
    return curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.plot", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders, each holding a metrics.jsonl")
    parser.add_argument("--out", default="loss.png", help="the PNG to write")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: the run folder names)")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(run).resolve().name for run in args.runs]
    if len(labels) != len(args.runs):
        raise UserError(f"--labels has {len(labels)} names for {len(args.runs)} runs; give one per run")
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: give an image file, e.g. --out {out / 'loss.png'}")
    out = out if out.suffix else out.with_suffix(".png")  # what matplotlib would write; now the message says so
    runs = [(label, read_metrics(Path(run))) for label, run in zip(labels, args.runs)]
    try:
        import matplotlib
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for i, (name, curves) in enumerate(runs):
        colour = f"C{i}"
        for ax, x in ((by_step, 0), (by_time, 1)):
            train, val = curves["train_loss"], curves["val_loss"]
            if train:
                ax.plot([r[x] for r in train], [r[2] for r in train], color=colour, alpha=0.3, linewidth=1)
            if val:
                ax.plot([r[x] for r in val], [r[2] for r in val], color=colour, marker="o", markersize=4,
                        label=name)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s)")
    by_step.set_ylabel("loss")
    by_step.legend(title="validation (markers), training (faint)", fontsize="small", title_fontsize="small")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
