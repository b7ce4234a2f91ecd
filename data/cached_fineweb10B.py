"""Download the speedrun's GPT-2-tokenized FineWeb shards: `python data/cached_fineweb10B.py N`.

Fetches fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_N.bin from the hub dataset
kjj0/fineweb10B-gpt2 at the commit REVISION into data/fineweb10B/, each checked against the SHA-256 the hub publishes
for it (its Git LFS object id). Verified files are recorded in MANIFEST, so later runs check them offline: a file of
unchanged size and modification time counts as verified, a changed one is hashed again. A partial or differing file
is deleted and fetched again. Without network it exits with status 2 and lists the missing files; files present but
not yet checked against the hub are used with a warning.
"""
import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

if not __package__:
    # Run as a script, Python puts data/ itself on sys.path; `import data.shard` needs the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import HfApi, RepoFile, constants, hf_hub_download  # noqa: E402

from data.shard import ShardError, read_header  # noqa: E402
from runtime.errors import UserError

REPO_ID = "kjj0/fineweb10B-gpt2"
REVISION = "889765ea1f903759787add96995d81171b632d0c"  # the dataset commit every file is fetched and checked at
TRAIN_SHARDS = 103  # the dataset's train files: fineweb_train_000001 ... 000103, about 10B tokens
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"
MANIFEST = "sha256_manifest.json"  # in the shards' folder: the files verified against the hub
HASH_CHUNK_BYTES = 1 << 24


class DownloadError(UserError):
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


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def _stamp(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def read_manifest(path: Path) -> dict[str, dict]:
    """The verified files recorded at `path`: {name: {"sha256", "size", "mtime_ns"}}; none when the manifest is
    missing, damaged or of another dataset or revision."""
    try:
        data = json.loads(path.read_text())
        if data["repo"] != REPO_ID or data["revision"] != REVISION:
            return {}
        return {str(name): {"sha256": str(entry["sha256"]), "size": int(entry["size"]),
                            "mtime_ns": int(entry["mtime_ns"])} for name, entry in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_manifest(path: Path, files: dict[str, dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"repo": REPO_ID, "revision": REVISION, "files": dict(sorted(files.items()))},
                              indent=1) + "\n")
    os.replace(tmp, path)  # atomic: an interrupted run leaves the previous manifest


def published_sha256(names: list[str], endpoint: str | None) -> dict[str, str]:
    """{name: the SHA-256 the hub publishes for it at REVISION, its Git LFS object id}, for the `names` it has."""
    infos = HfApi(endpoint=endpoint).get_paths_info(REPO_ID, names, repo_type="dataset", revision=REVISION)
    return {info.path: info.lfs.sha256 for info in infos if isinstance(info, RepoFile) and info.lfs is not None}


def _unreachable(error: Exception, missing: list[Path], out_dir: Path, n_train: int) -> DownloadError:
    offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
    names = [p.name for p in missing]
    listed = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    reason = " ".join(str(error).split())  # the hub's messages span lines; the summary stays short
    return DownloadError(
        f"could not download from the hub dataset {REPO_ID}{offline}: {reason}\n"
        f"{len(names)} file(s) still missing in {out_dir}: {listed}\n"
        f"run `python data/cached_fineweb10B.py {n_train}` again with network access, or copy these files "
        f"into {out_dir}/")


def download(n_train: int, out_dir=DEFAULT_DIR, endpoint: str | None = None) -> list[Path]:
    """Makes sure the val shard and the first `n_train` train shards are in `out_dir`, whole and, where the hub is
    reachable, with its published SHA-256; returns their paths."""
    if not 1 <= n_train <= TRAIN_SHARDS:
        raise UserError(f"N={n_train}: the dataset has train shards 1 to {TRAIN_SHARDS}")
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DownloadError(f"cannot make the folder {out_dir} ({error.strerror}): give --out a folder you can "
                            f"write to") from None
    paths = [out_dir / name for name in shard_names(n_train)]
    manifest = out_dir / MANIFEST
    verified = read_manifest(manifest)
    missing, unchecked = [], []
    for path in paths:
        if path.is_dir():
            raise DownloadError(f"{path} is a folder where a shard belongs: move it away and run again")
        if path.exists() and not is_complete(path):
            print(f"{path} is incomplete: fetching it again", file=sys.stderr)
            path.unlink()
        if not path.exists():
            missing.append(path)
        elif path.name not in verified:
            unchecked.append(path)
        elif _stamp(path) != {k: verified[path.name][k] for k in ("size", "mtime_ns")}:
            # changed or copied since verified: checked against the recorded hash
            recorded, actual = verified.pop(path.name)["sha256"], file_sha256(path)
            if actual == recorded:
                verified[path.name] = {"sha256": actual, **_stamp(path)}
            else:
                print(f"{path} has sha256 {actual}, not the {recorded} verified before: deleting it and fetching it "
                      f"again", file=sys.stderr)
                path.unlink()
                missing.append(path)
            write_manifest(manifest, verified)
    if not missing and not unchecked:
        return paths

    try:
        published = published_sha256([p.name for p in missing + unchecked], endpoint)
    except Exception as error:
        # offline mode and HTTP statuses raise OSErrors, an unreachable network httpx's errors
        if missing:
            raise _unreachable(error, missing, out_dir, n_train) from None
        print(f"warning: could not reach the hub to check {len(unchecked)} shard(s) in {out_dir} against the SHA-256 "
              f"it publishes ({' '.join(str(error).split())}); using them unchecked, as their headers and sizes are "
              f"right; run `python data/cached_fineweb10B.py {n_train}` with network access to check them",
              file=sys.stderr)
        return paths
    unpublished = [p.name for p in missing + unchecked if p.name not in published]
    if unpublished:
        raise DownloadError(f"the hub dataset {REPO_ID} publishes no SHA-256 for {', '.join(unpublished)} at revision "
                            f"{REVISION}, so it cannot be checked: see "
                            f"https://huggingface.co/datasets/{REPO_ID}/tree/{REVISION}")

    def record(path: Path) -> None:
        verified[path.name] = {"sha256": published[path.name], **_stamp(path)}
        write_manifest(manifest, verified)  # after each file: an interrupted run keeps what it verified

    for path in unchecked:
        actual = file_sha256(path)
        if actual == published[path.name]:
            record(path)
        else:
            print(f"{path} has sha256 {actual}, but the hub publishes {published[path.name]} for it: deleting it and "
                  f"fetching it again", file=sys.stderr)
            path.unlink()
            missing.append(path)
    missing.sort(key=paths.index)
    for i, path in enumerate(missing):
        try:
            hf_hub_download(REPO_ID, path.name, repo_type="dataset", revision=REVISION, local_dir=out_dir,
                            endpoint=endpoint)
        except OSError as error:  # huggingface_hub wraps offline, connection and HTTP errors in OSErrors here
            raise _unreachable(error, missing[i:], out_dir, n_train) from None
        if not is_complete(path):
            path.unlink()
            raise DownloadError(f"{path} arrived damaged (its header or size is wrong): run the command again")
        actual = file_sha256(path)
        if actual != published[path.name]:
            path.unlink()
            raise DownloadError(f"{path} arrived with sha256 {actual}, but the hub publishes {published[path.name]} "
                                f"for it at revision {REVISION}: deleted it; run the command again")
        record(path)
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
