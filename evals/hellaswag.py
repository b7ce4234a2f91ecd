"""HellaSwag accuracy (Zellers et al. 2019) of a trained GPT, scored the way llm.c scores it.

    python -m evals.hellaswag --checkpoint logs/RUN/ckpt_001750.pt [--limit 1000]
    torchrun --standalone --nproc_per_node=8 -m evals.hellaswag --checkpoint ...   # examples split over ranks
    python train_gpt2.py --hellaswag=1                                            # at the end of training

An example is a context and four endings. Each ending is scored by the mean loss of its tokens given
[BOS] + context (the ending tokenized with its leading space, as it would appear in running text; BOS
because every training document starts with it, where llm.c's GPT-2 rows start with the context); the
prediction is the ending with the lowest mean loss. This length-normalised completion scoring is llm.c's
acc_norm, by which OpenAI's GPT-2 checkpoints score 29.55% (124M) and 48.93% (1.5B).

The data is the 10,042-example validation set, downloaded once into data/hellaswag/ and checked (line count
and fields; the upstream repository publishes no checksum). Offline, pass a local copy with --hellaswag_file.
"""
import argparse
import json
import math
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.shard import BOS_ID
from data.tokenizer import get_encoding
from runtime import dist
from runtime.checkpoint import load_model
from runtime.errors import exit_on_user_error

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE = Path(__file__).resolve().parent.parent / "data" / "hellaswag" / "hellaswag_val.jsonl"
NUM_VAL_EXAMPLES = 10_042  # the validation split's size (Zellers et al. 2019; llm.c evaluates the same file)
NUM_ENDINGS = 4
EXAMPLES_PER_BATCH = 8  # 32 rows of a few hundred tokens: fills a GPU, one shape per padded length


def _missing_message(reason: str) -> str:
    return (f"the HellaSwag validation file {CACHE} is missing and {reason}. Download {URL} on a machine with "
            f"network and pass it with --hellaswag_file PATH (or copy it to {CACHE})")


def _check_download_allowed() -> None:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ValueError(_missing_message("HF_HUB_OFFLINE=1 forbids downloading it"))


def _check_file(path: Path) -> None:
    if not path.is_file():
        what = "a folder" if path.is_dir() else "no such file"
        raise ValueError(f"--hellaswag_file {path}: {what}; pass a copy of {URL}")


def check_available(path: str | None) -> None:
    """Raise now what select_examples(path, ...) would raise later for want of its file: a missing `path`, or, when
    `path` is None, no cached file and downloads forbidden. train_gpt2 --hellaswag=1 calls it at start-up, so that a
    run does not train for hours and then fail (without --checkpoint_every, losing the model). Downloads nothing."""
    if path:
        _check_file(Path(path))
    elif not CACHE.is_file():
        _check_download_allowed()


def download(dest: Path = CACHE) -> Path:
    """Fetch the validation file into `dest` once; the file appears only after its checks pass."""
    _check_download_allowed()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")  # per process: ranks may download at once
    try:
        try:
            with urllib.request.urlopen(URL, timeout=60) as response, open(tmp, "wb") as f:
                f.write(response.read())
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(_missing_message(f"downloading it failed ({e})")) from None
        examples = load_examples(tmp)
        if len(examples) != NUM_VAL_EXAMPLES:
            raise ValueError(f"the download from {URL} has {len(examples)} examples, expected {NUM_VAL_EXAMPLES}: "
                             f"the upstream file changed; pass a known-good copy with --hellaswag_file")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def load_examples(path: Path) -> list[dict]:
    """The examples of a hellaswag_val.jsonl-format file; a ValueError names the file and line of a bad one."""
    path = Path(path)
    _check_file(path)
    examples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                ex = json.loads(raw.decode("utf-8"))
                ok = (isinstance(ex.get("ctx"), str) and isinstance(ex.get("endings"), list)
                      and len(ex["endings"]) == NUM_ENDINGS and all(isinstance(e, str) for e in ex["endings"])
                      and ex.get("label") in range(NUM_ENDINGS))
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):  # a binary file fails here
                ok = False
            if not ok:
                raise ValueError(f"{path}:{lineno} is not a HellaSwag example (a JSON object with a string 'ctx', "
                                 f"{NUM_ENDINGS} string 'endings' and a 'label' 0-{NUM_ENDINGS - 1}); pass a copy "
                                 f"of {URL} with --hellaswag_file")
            examples.append(ex)
    return examples


def select_examples(path: str | None, limit: int | None) -> list[dict]:
    """The first `limit` (None: all) examples of `path`, or of the cached validation set (downloaded on first
    use) when `path` is None."""
    if path:
        examples = load_examples(Path(path))
    else:
        if not CACHE.is_file():
            download(CACHE)
        examples = load_examples(CACHE)
        if len(examples) != NUM_VAL_EXAMPLES:
            raise ValueError(f"{CACHE} has {len(examples)} examples, expected {NUM_VAL_EXAMPLES}: it is damaged; "
                             f"delete it to download it again")
    if not examples[:limit]:
        raise ValueError(f"no HellaSwag examples to score in {path or CACHE} (limit {limit})")
    return examples[:limit]


def render(example: dict, enc) -> list[tuple[list[int], list[int]]]:
    """(context tokens with a leading BOS, ending tokens) for each ending."""
    context = [BOS_ID] + enc.encode_ordinary(example["ctx"])
    return [(context, enc.encode_ordinary(" " + ending)) for ending in example["endings"]]


@torch.no_grad()
def ending_losses(model, rows: list[tuple[list[int], list[int]]], num_rows: int, device) -> torch.Tensor:
    """Mean loss of each row's ending tokens given its context, shape (len(rows),).

    The batch has `num_rows` rows (unused ones are all padding) and a length rounded up to the attention block,
    so a compiled model sees few shapes. Padding is BOS on the right; attention is causal, so it never changes
    the real tokens' losses. Only the ending positions go through the LM head: the full (rows, T, vocab)
    logits would be ~10x the work and 1.6 GB at 32 rows of 256 tokens.
    """
    block = model.config.block_size
    T = math.ceil(max(len(c) + len(e) for c, e in rows) / block) * block
    inputs = torch.full((num_rows, T), BOS_ID, dtype=torch.int32)
    targets = torch.full((num_rows, T), -100, dtype=torch.int64)
    for i, (context, ending) in enumerate(rows):
        tokens = context + ending
        inputs[i, :len(tokens)] = torch.tensor(tokens)
        # position t predicts token t + 1: the ending's tokens are predicted from len(context) - 1 onwards
        targets[i, len(context) - 1:len(tokens) - 1] = torch.tensor(ending)
    inputs, targets = inputs.to(device), targets.to(device)
    # twice the row length: the short-window layers (half the long window) see the whole row as well
    window = torch.tensor(2 * T, dtype=torch.int64, device=device)
    scored_BT = targets != -100
    logits_NV = model.head.logits(model.hidden_states(inputs, window)[scored_BT])
    losses_N = F.cross_entropy(logits_NV, targets[scored_BT], reduction="none")
    row_N = scored_BT.nonzero()[:, 0]
    sums = torch.zeros(num_rows, device=device).index_add_(0, row_N, losses_N)
    return (sums / scored_BT.sum(dim=1).clamp_min(1))[:len(rows)].cpu()


def count_correct(model, rt: dist.Runtime, examples: list[dict]) -> tuple[int, int]:
    """(correct, total) over all ranks; rank r scores examples r, r + world_size, ..."""
    device = next(model.parameters()).device
    enc = get_encoding()
    mine = examples[rt.rank::rt.world_size]
    backend = model.attention_backend
    # FlexAttention needs CUDA for speed; on the CPU the explicit mask is faster at these short lengths
    model.attention_backend = "flex" if device.type == "cuda" else "sdpa"
    correct = 0
    try:
        # After training (train_gpt2 --hellaswag=1) the compiled regions hold graphs for the training and validation
        # shapes only; these rows are new shapes. Compiling them would cost minutes on a GPU, and once the blocks'
        # graphs pass dynamo's recompile limit, the fullgraph compile fails. So new shapes run eagerly.
        with torch.compiler.set_stance("eager_on_recompile"):
            batches = range(0, len(mine), EXAMPLES_PER_BATCH)
            for start in tqdm(batches, desc="hellaswag", disable=not (rt.is_master and sys.stderr.isatty())):
                chunk = mine[start:start + EXAMPLES_PER_BATCH]
                rows = [row for ex in chunk for row in render(ex, enc)]
                losses = ending_losses(model, rows, NUM_ENDINGS * EXAMPLES_PER_BATCH, device).view(-1, NUM_ENDINGS)
                labels = torch.tensor([ex["label"] for ex in chunk])
                correct += int((losses.argmin(dim=1) == labels).sum())
    finally:
        model.attention_backend = backend
    return int(dist.all_ranks_sum(correct, rt)), len(examples)


def evaluate_hellaswag(model, rt: dist.Runtime, path: str | None = None, limit: int | None = None) -> float:
    """Accuracy on HellaSwag validation (or on `path`, a file in the same format), the same on every rank.

    Every rank must call it. `limit` keeps the first `limit` examples.
    """
    correct, total = count_correct(model, rt, select_examples(path, limit))
    return correct / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.hellaswag", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a ckpt_<step>.pt file or the run folder holding it")
    parser.add_argument("--hellaswag_file", default="", help=f"local copy of {URL} (default: download it)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples (0 = all)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        raise ValueError(f"--limit={args.limit} must be 0 (all examples) or positive")
    rt = dist.setup(args.device)
    try:
        # the checkpoint first: the argument the user typed, where the data file may be the default download
        model, _ = load_model(args.checkpoint, rt.device)
        correct, total = count_correct(model, rt, select_examples(args.hellaswag_file, args.limit or None))
        if rt.is_master:
            print(f"hellaswag accuracy: {correct / total:.4f} ({correct}/{total})")
    finally:
        dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
