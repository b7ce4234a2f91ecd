"""Download the speedrun's GPT-2-tokenized FineWeb shards: `python data/cached_fineweb10B.py N`.

Fetches fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_N.bin (100M tokens each:
data.shard.FINEWEB_SHARD_TOKENS) from the hub dataset kjj0/fineweb10B-gpt2 into data/fineweb10B/. A file already
there counts only if its header and size check out; a partial file is deleted and fetched again. Without network
(or with HF_HUB_OFFLINE=1) it exits with status 2 and lists the files still missing.
"""
import argparse
import sys
from pathlib import Path

if not __package__:
    # Run as a script, Python puts data/ itself on sys.path; `import data.shard` needs the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import constants, hf_hub_download  # noqa: E402

from data.shard import ShardError, read_header  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS = 103  # the dataset's train files: fineweb_train_000001 ... 000103, about 10B tokens
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"


class DownloadError(ValueError):
    """Shards could not be fetched; the message lists the missing files and how to get them."""


def shard_names(n_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def is_complete(path: Path) -> bool:
    """True when `path` is a whole shard: read_header checks magic, version and size = header + 2 * count."""
    try:
        read_header(path)
    except (ShardError, OSError):
        return False
    return True


def download(n_train: int, out_dir=DEFAULT_DIR, endpoint: str | None = None) -> list[Path]:
    """Make sure the val shard and the first `n_train` train shards are complete in `out_dir`; return their paths."""
    if not 1 <= n_train <= TRAIN_SHARDS:
        raise ValueError(f"N={n_train}: the dataset has train shards 1 to {TRAIN_SHARDS}")
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DownloadError(f"cannot make the folder {out_dir} ({error.strerror}): give --out a folder you can "
                            f"write to") from None
    paths = [out_dir / name for name in shard_names(n_train)]
    missing = []
    for path in paths:
        if path.is_dir():
            raise DownloadError(f"{path} is a folder where a shard belongs: move it away and run again")
        if path.exists() and not is_complete(path):
            print(f"{path} is incomplete: fetching it again", file=sys.stderr)
            path.unlink()
        if not path.exists():
            missing.append(path)
    for i, path in enumerate(missing):
        try:
            hf_hub_download(REPO_ID, path.name, repo_type="dataset", local_dir=out_dir, endpoint=endpoint)
        except OSError as error:  # huggingface_hub's offline, connection and HTTP errors are all OSErrors
            offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
            names = [p.name for p in missing[i:]]
            listed = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
            reason = " ".join(str(error).split())  # the hub's messages span lines; the summary stays short
            raise DownloadError(
                f"could not download from the hub dataset {REPO_ID}{offline}: {reason}\n"
                f"{len(names)} file(s) still missing in {out_dir}: {listed}\n"
                f"run `python data/cached_fineweb10B.py {n_train}` again with network access, or copy these files "
                f"into {out_dir}/") from None
        if not is_complete(path):
            path.unlink()
            raise DownloadError(f"{path} arrived damaged (its header or size is wrong): run the command again")
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python data/cached_fineweb10B.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("n_train", type=int, nargs="?", default=TRAIN_SHARDS, metavar="N",
                        help=f"train shards of 100M tokens to fetch (default {TRAIN_SHARDS}: all of them)")
    parser.add_argument("--out", default=DEFAULT_DIR, help="target directory (default data/fineweb10B)")
    args = parser.parse_args(argv)
    try:
        paths = download(args.n_train, args.out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"{len(paths)} complete shards in {args.out}")


if __name__ == "__main__":
    main()
