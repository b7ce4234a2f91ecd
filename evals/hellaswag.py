"""HellaSwag accuracy (Zellers et al. 2019) of a trained GPT, scored the way llm.c scores it.

    python -m evals.hellaswag --checkpoint logs/RUN/ckpt_001750.pt [--limit 1000]
    torchrun --standalone --nproc_per_node=8 -m evals.hellaswag --checkpoint ...   # examples split over ranks
    python train_gpt2.py --hellaswag=1                                            # at the end of training

Each of an example's four endings (with its leading space) is scored by the mean loss of its tokens given
[BOS] + context, BOS because every training document starts with it; the prediction is the lowest. This is llm.c's
acc_norm, by which OpenAI's GPT-2 124M scores 29.55%.

The validation set is downloaded once into data/hellaswag/ from a pinned upstream commit and checked against the
git blob id that commit records, the only checksum upstream publishes. Offline, pass a copy with --hellaswag_file;
a file that differs from the pinned one is scored with a warning.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from data.shard import BOS_ID
from data.tokenizer import get_encoding
from evals.validation import choose_int8_layers
from runtime import dist
from runtime.checkpoint import load_model
from runtime.config import ATTENTION_FORWARDS
from runtime.errors import UserError, exit_on_user_error

COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"  # of github.com/rowanz/hellaswag: a commit's files never change
URL = f"https://raw.githubusercontent.com/rowanz/hellaswag/{COMMIT}/data/hellaswag_val.jsonl"
# the file's git blob id in COMMIT's tree
VAL_BLOB_ID = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
CACHE = Path(__file__).resolve().parent.parent / "data" / "hellaswag" / "hellaswag_val.jsonl"
NUM_ENDINGS = 4
EXAMPLES_PER_BATCH = 8  # 32 rows fill a GPU


def _missing_message(reason: str) -> str:
    return (f"the HellaSwag validation file {CACHE} is missing and {reason}. Download {URL} on a machine with "
            f"network and pass it with --hellaswag_file PATH (or copy it to {CACHE})")


def _check_download_allowed() -> None:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError(_missing_message("HF_HUB_OFFLINE=1 forbids downloading it"))


def _check_file(path: Path) -> None:
    if not path.is_file():
        what = "a folder" if path.is_dir() else "no such file"
        raise UserError(f"--hellaswag_file {path}: {what}; pass a copy of {URL}")


def git_blob_id(path: Path) -> str:
    """The id git gives the file's content: SHA-1 over b"blob <size>\\0" and the bytes."""
    sha = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _check_cache() -> None:
    blob = git_blob_id(CACHE)
    if blob != VAL_BLOB_ID:
        raise UserError(f"{CACHE} differs from the HellaSwag validation file of the pinned commit (git blob {blob}, "
                         f"expected {VAL_BLOB_ID}): it is damaged or another file; delete it to download the pinned "
                         f"one again, or pass it with --hellaswag_file to score it anyway")


def _warn_if_not_pinned(path: Path) -> None:
    blob = git_blob_id(path)
    if blob != VAL_BLOB_ID and int(os.environ.get("RANK", "0")) == 0:  # once, not once per process
        print(f"warning: --hellaswag_file {path} differs from the HellaSwag validation file of the pinned commit "
              f"(git blob {blob}, expected {VAL_BLOB_ID}, {URL}): scoring it anyway, but its accuracy does not "
              f"compare with published HellaSwag scores", file=sys.stderr)


def check_available(path: str | None) -> None:
    """Raises now what select_examples(path, ...) would raise later for want of its file, without downloading, so
    that a run with --hellaswag=1 does not fail after training."""
    if path:
        _check_file(Path(path))
    elif CACHE.is_file():
        _check_cache()
    else:
        _check_download_allowed()


def download(dest: Path = CACHE) -> Path:
    """Fetches the validation file into `dest`, which appears only with the pinned git blob id."""
    _check_download_allowed()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")  # per process: ranks may download at once
    try:
        try:
            with urllib.request.urlopen(URL, timeout=60) as response, open(tmp, "wb") as f:
                f.write(response.read())
        except (urllib.error.URLError, OSError) as e:
            raise UserError(_missing_message(f"downloading it failed ({e})")) from None
        blob = git_blob_id(tmp)
        if blob != VAL_BLOB_ID:
            raise UserError(f"the download from {URL} has git blob id {blob}, not the {VAL_BLOB_ID} its commit "
                             f"records: deleted it (damaged in transit, or not the file); try again, or pass a "
                             f"known-good copy with --hellaswag_file")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def load_examples(path: Path) -> list[dict]:
    """The examples of a hellaswag_val.jsonl-format file; a UserError names the file and line of a bad one."""
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
                raise UserError(f"{path}:{lineno} is not a HellaSwag example (a JSON object with a string 'ctx', "
                                 f"{NUM_ENDINGS} string 'endings' and a 'label' 0-{NUM_ENDINGS - 1}); pass a copy "
                                 f"of {URL} with --hellaswag_file")
            examples.append(ex)
    return examples


def select_examples(path: str | None, limit: int | None) -> list[dict]:
    """The first `limit` (None: all) examples of `path`, or of the cached validation set when `path` is None."""
    if path:
        examples = load_examples(Path(path))
        _warn_if_not_pinned(Path(path))
    else:
        if CACHE.is_file():
            _check_cache()
        else:
            download(CACHE)
        examples = load_examples(CACHE)
    if not examples[:limit]:
        raise UserError(f"no HellaSwag examples to score in {path or CACHE} (limit {limit})")
    return examples[:limit]


def render(example: dict, enc) -> list[tuple[list[int], list[int]]]:
    """(context tokens with a leading BOS, ending tokens) for each ending."""
    context = [BOS_ID] + enc.encode_ordinary(example["ctx"])
    return [(context, enc.encode_ordinary(" " + ending)) for ending in example["endings"]]


def batch(rows: list[tuple[list[int], list[int]]], num_rows: int, block: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, targets (num_rows, T), window): the rows padded on the right to whole attention blocks, the targets
    only at the ending's positions (else -100), and a window over the whole row for every layer."""
    T = math.ceil(max(len(c) + len(e) for c, e in rows) / block) * block
    inputs = torch.full((num_rows, T), BOS_ID, dtype=torch.int32)
    targets = torch.full((num_rows, T), -100, dtype=torch.int64)
    for i, (context, ending) in enumerate(rows):
        tokens = context + ending
        inputs[i, :len(tokens)] = torch.tensor(tokens)
        # position t predicts token t + 1
        targets[i, len(context) - 1:len(tokens) - 1] = torch.tensor(ending)
    # twice the row length: the short-window layers see the whole row too
    return inputs.to(device), targets.to(device), torch.tensor(2 * T, dtype=torch.int64, device=device)


@torch.no_grad()
def ending_losses(model, rows: list[tuple[list[int], list[int]]], num_rows: int, device) -> Tensor:
    """Mean loss of each row's ending tokens given its context, (len(rows),), in a batch of `num_rows` rows (`batch`);
    only the ending positions go through the LM head."""
    inputs, targets, window = batch(rows, num_rows, model.config.block_size, device)
    scored_BT = targets != -100
    logits_NV = model.head.logits(model.hidden_states(inputs, window)[scored_BT])
    losses_N = F.cross_entropy(logits_NV, targets[scored_BT], reduction="none")
    row_N = scored_BT.nonzero()[:, 0]
    sums = torch.zeros(num_rows, device=device).index_add_(0, row_N, losses_N)
    return (sums / scored_BT.sum(dim=1).clamp_min(1))[:len(rows)].cpu()


def count_correct(model, rt: dist.Runtime, examples: list[dict], int8_attention: bool = False) -> tuple[int, int]:
    """(correct, total) over all ranks; rank r scores examples r, r + world_size, ... With int8_attention (a
    model/fast FastGPT), the layers choose INT8/FP8 attention by evals.validation's rule on the first batch."""
    device = next(model.parameters()).device
    enc = get_encoding()
    mine = examples[rt.rank::rt.world_size]
    backend = model.attention_backend
    # on the CPU the explicit mask is faster at these lengths
    model.attention_backend = "flex" if device.type == "cuda" else "sdpa"
    correct = 0
    try:
        # new shapes run eagerly: compiling them costs minutes and can pass dynamo's recompile limit
        with torch.compiler.set_stance("eager_on_recompile"):
            batches = range(0, len(mine), EXAMPLES_PER_BATCH)
            for start in tqdm(batches, desc="hellaswag", disable=not (rt.is_master and sys.stderr.isatty())):
                chunk = mine[start:start + EXAMPLES_PER_BATCH]
                rows = [row for ex in chunk for row in render(ex, enc)]
                if int8_attention and start == 0:
                    inputs, _, window = batch(rows, len(rows), model.config.block_size, device)
                    choose_int8_layers(model, inputs, window, rt)
                losses = ending_losses(model, rows, NUM_ENDINGS * EXAMPLES_PER_BATCH, device).view(-1, NUM_ENDINGS)
                labels = torch.tensor([ex["label"] for ex in chunk])
                correct += int((losses.argmin(dim=1) == labels).sum())
    finally:
        model.attention_backend = backend
    return int(dist.all_ranks_sum(correct, rt)), len(examples)


def evaluate_hellaswag(model, rt: dist.Runtime, path: str | None = None, limit: int | None = None,
                       int8_attention: bool = False) -> float:
    """Accuracy on HellaSwag validation (or `path`, in its format) over the first `limit` examples; every rank
    calls it and gets the same value."""
    correct, total = count_correct(model, rt, select_examples(path, limit), int8_attention)
    return correct / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.hellaswag", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a ckpt_<step>.pt file or the run folder holding it")
    parser.add_argument("--hellaswag_file", default="", help=f"local copy of {URL} (default: download it)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples (0 = all)")
    parser.add_argument("--attention_forward", default="bf16", choices=ATTENTION_FORWARDS,
                        help="bf16 (FlexAttention) or int8 (INT8/FP8 attention where a layer's error allows)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        raise UserError(f"--limit={args.limit} must be 0 (all examples) or positive")
    rt = dist.setup(args.device)
    try:
        # the checkpoint first: the argument the user typed
        model, _ = load_model(args.checkpoint, rt.device, attention_forward=args.attention_forward)
        correct, total = count_correct(model, rt, select_examples(args.hellaswag_file, args.limit or None),
                                       args.attention_forward == "int8")
        if rt.is_master:
            print(f"hellaswag accuracy: {correct / total:.4f} ({correct}/{total})")
    finally:
        dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
