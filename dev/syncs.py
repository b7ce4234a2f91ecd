"""Which calls of a GPU run make the host wait for the GPU: train_gpt2.py under CUDA's sync debug mode, each
synchronizing call counted by where it was made.

    python -m dev.syncs --train_files=... --val_files=... --num_iterations=12 > syncs.txt

The arguments are train_gpt2.py's. Each row: how many times, the seven innermost frames, and after "||" the
innermost two frames of train_gpt2.py, which say whether the call came from the set-up, the warm-up or the timed
loop (they call train_step from different lines). A timed step should make none: the loop reads each step's loss one
step late (runtime.control.LossRecord). torch calls the mode a prototype that does not catch every synchronizing call.
"""
import collections
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROWS = 40
REPO = Path(__file__).resolve().parent.parent


def main():
    if not torch.cuda.is_available():
        sys.exit("error: dev.syncs watches a GPU run's synchronizing calls, and this machine has no GPU")
    counts = collections.Counter()

    def count(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-2]]
        ours = [s for s in stack if "train_gpt2.py" in s][-2:]
        counts[" < ".join(reversed(stack[-7:])) + " || " + " < ".join(reversed(ours))] += 1

    warnings.showwarning = count
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["train_gpt2.py", *sys.argv[1:]]
    try:
        runpy.run_path(str(REPO / "train_gpt2.py"), run_name="__main__")
    except SystemExit as end:
        print(f"train_gpt2.py exited with status {end.code}")
    for where, n in counts.most_common(ROWS):
        print(n, where)


if __name__ == "__main__":
    main()
