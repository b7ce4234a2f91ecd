"""Tokenize your own text into train/val shards.

    python -m data.prepare INPUT... --out DIR [--val_tokens N] [--shard_tokens N] [--workers N] [--name PREFIX]

INPUTs are files or directories (searched recursively, hidden entries skipped) of `.txt` / `.md` files (one
file is one document) and `.jsonl` files (one document per line, its "text" field), each optionally gzipped.
Every document is GPT-2 encoded and preceded by <|endoftext|>. The first val_tokens + 1 tokens go to
`<name>_val_000000.bin` (the + 1 is the input before the first prediction, so training with the same
`--val_tokens` finds exactly enough), the rest to `<name>_train_000001.bin, ...` of shard_tokens each: the
layout of the FineWeb shards. A .txt/.md file that is not UTF-8 is skipped with a warning and counted in the
summary; a .jsonl line that is not a UTF-8 JSON object with a "text" string is an error naming file:line.
Errors exit with status 2 and leave no partial output.
"""
import argparse
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shard import BOS_ID, FINEWEB_SHARD_TOKENS, write_shard
from data.tokenizer import get_encoding

TEXT_SUFFIXES, JSONL_SUFFIXES = (".txt", ".md"), (".jsonl",)
DEFAULT_VAL_TOKENS = 10_485_760  # the speedrun's validation set size
BATCH_CHARS = 1 << 20  # text per worker task: large enough to hide IPC, small enough to balance the pool
SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE_VAL_TOKENS = 65_536  # enough for a steady smoke-run validation loss, small next to the ~1.5M-token sample


class PrepareError(ValueError):
    """A problem with the inputs or options of data.prepare; the message names the file or flag."""


def _kind(path: Path) -> str | None:
    name = path.name.removesuffix(".gz")
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else None


def input_files(inputs, ignored: list[Path] | None = None) -> list[Path]:
    """The files to read, in a deterministic order: inputs as given, each directory's files sorted, each file once
    (a file named twice, or inside a folder also given, would land in both splits). A directory's files of other
    types are appended to `ignored`."""
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            visible = sorted(p for p in given.rglob("*") if p.is_file()
                             and not any(part.startswith(".") for part in p.relative_to(given).parts))
            files += [p for p in visible if _kind(p)]
            if ignored is not None:
                ignored += [p for p in visible if not _kind(p)]
        elif given.is_file():
            if not _kind(given):
                raise PrepareError(f"{given}: unsupported file type; data.prepare reads .txt, .md and .jsonl "
                                   "files, optionally gzipped (.txt.gz, ...)")
            files.append(given)
        else:
            raise PrepareError(f"input {given} does not exist: pass existing files or directories")
    first = {}  # each file's first mention, in the order given
    for path in files:
        first.setdefault(path.resolve(), path)
    once = list(first.values())
    if len(once) < len(files):
        print(f"warning: {len(files) - len(once)} file(s) given more than once (by name, or inside a folder also "
              f"given) are read once", file=sys.stderr)
    return once


def _read(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as error:
        raise PrepareError(f"{path}: not a valid gzip file ({error}); fix or remove it") from None


def documents(files, skipped: list[Path]):
    """Yield the documents of `files`; files skipped for not being UTF-8 are appended to `skipped`."""
    for path in files:
        raw = _read(path)
        if _kind(path) == "text":
            try:
                text = raw.decode("utf-8-sig")  # a leading byte-order mark is no part of the text
            except UnicodeDecodeError as error:
                source = "utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin1"  # UTF-16 starts with a BOM
                print(f"warning: skipping {path}: not UTF-8 text ({error.reason} at byte {error.start}); convert "
                      f"it to include it, e.g. `iconv -f {source} -t utf-8`", file=sys.stderr)
                skipped.append(path)
                continue
            if text:
                yield text
            continue
        for number, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise PrepareError(f"{path}:{number}: not a UTF-8 JSON object ({error}); every non-empty line of a "
                                   "JSON Lines file must be one object with a \"text\" string") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise PrepareError(f"{path}:{number}: no \"text\" string in this JSON line; every non-empty line "
                                   "must be an object with a \"text\" field")
            if record["text"]:
                yield record["text"]


def _batches(docs):
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_batch(docs: list[str]) -> np.ndarray:
    """BOS + GPT-2 tokens of each document, concatenated."""
    encoding = get_encoding()
    tokens = []
    for doc in docs:
        tokens.append(BOS_ID)
        tokens += encoding.encode_ordinary(doc)
    return np.array(tokens, dtype=np.uint16)


def _encoded(batches, workers: int):
    """encode_batch over `batches`, in order."""
    if workers == 1:  # in-process: no pool start-up for small jobs
        yield from map(encode_batch, batches)
        return
    # spawn, not fork: a caller (a training script) may hold threads that fork would copy mid-lock.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=get_encoding) as pool:
        yield from pool.imap(encode_batch, batches)  # ordered, so the output is deterministic


class _ShardWriter:
    """Cuts the token stream into the val shard (first) and train shards, writing each as soon as it is full."""

    def __init__(self, out: Path, name: str, val_tokens: int, shard_tokens: int):
        self.out, self.name, self.shard_tokens = out, name, shard_tokens
        self.pending, self.pending_len = [], 0
        self.names, self.sizes = [], []  # written shards in stream order, val first
        self.target = val_tokens + 1

    def _write(self, tokens: np.ndarray) -> None:
        split = "val" if not self.sizes else "train"
        self.names.append(f"{self.name}_{split}_{len(self.sizes):06d}.bin")
        write_shard(self.out / self.names[-1], tokens)
        self.sizes.append(len(tokens))
        self.target = self.shard_tokens

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        while self.pending_len >= self.target:
            stream = np.concatenate(self.pending)
            self._write(stream[:self.target])
            self.pending, self.pending_len = [stream[self.sizes[-1]:]], len(stream) - self.sizes[-1]

    def close(self) -> None:
        if self.pending_len:
            self._write(np.concatenate(self.pending))


def prepare(inputs, out, val_tokens: int = DEFAULT_VAL_TOKENS, shard_tokens: int = FINEWEB_SHARD_TOKENS,
            name: str = "corpus", workers: int | None = None) -> dict:
    """Tokenize `inputs` into shards in `out` (see the module docstring); return a summary dict."""
    start = time.perf_counter()
    workers = os.cpu_count() if workers is None else workers
    if val_tokens < 1 or not 1 <= shard_tokens < 2**31 or workers < 1:
        raise PrepareError(f"--val_tokens={val_tokens}, --shard_tokens={shard_tokens} and --workers={workers} must "
                           "be positive (and --shard_tokens below 2**31)")
    if not name or "/" in name:
        raise PrepareError(f"--name={name!r} must be a plain file name prefix")
    ignored = []
    files = input_files(inputs, ignored)
    try:
        get_encoding()  # missing or damaged vocabulary files fail here, before any output or worker exists
    except OSError as error:
        raise PrepareError(f"cannot read the GPT-2 tokenizer file {error.filename} ({error.strerror}): restore it "
                           f"with `git checkout -- data/gpt2`") from None
    except ValueError as error:  # a damaged file: the message names it and the fix
        raise PrepareError(str(error)) from None
    out = Path(out)
    if out.is_dir() and any(out.glob(f"{name}_*.bin")):
        raise PrepareError(f"{out} already holds {name}_*.bin shards: remove them, or choose another --out or --name")
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file: give a folder (new or existing) for the shards")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))  # shards appear in `out` only on success
    except OSError as error:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise PrepareError(f"cannot write to --out {out} ({error.strerror}): choose a folder you can write "
                           f"to") from None
    skipped, doc_count = [], 0

    def counted(docs):
        nonlocal doc_count
        for doc in docs:
            doc_count += 1
            yield doc

    try:
        writer = _ShardWriter(staging, name, val_tokens, shard_tokens)
        batches = _batches(counted(documents(files, skipped)))
        with tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=None) as progress:
            for tokens in _encoded(batches, workers):
                writer.add(tokens)
                progress.update(len(tokens))
        total = sum(writer.sizes) + writer.pending_len
        if doc_count == 0:
            raise PrepareError(f"no documents found in {', '.join(map(str, inputs))} ({len(files)} readable "
                               f"files, {len(skipped)} skipped): give .txt/.md/.jsonl files with text in them")
        if total <= val_tokens + 1:
            # The advice must pass this check itself: 1 <= --val_tokens <= total - 2 (at least one train token).
            fix = (f"lower --val_tokens (e.g. to {max(1, total // 10):,}) or add text" if total >= 3 else
                   "add text (the smallest --val_tokens, 1, needs 3 tokens: 2 for validation, 1 for training)")
            raise PrepareError(f"the corpus has {total:,} tokens, but the validation shard alone takes --val_tokens "
                               f"+ 1 = {val_tokens + 1:,}: {fix}")
        writer.close()
        shards = [out / shard for shard in writer.names]
        for shard in writer.names:
            os.replace(staging / shard, out / shard)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    staging.rmdir()
    seconds = time.perf_counter() - start
    return {"files": len(files), "skipped_files": len(skipped), "ignored_files": len(ignored),
            "documents": doc_count, "tokens": total,
            "val_tokens": writer.sizes[0], "train_tokens": total - writer.sizes[0], "shards": shards,
            "seconds": seconds, "tokens_per_second": total / seconds}


def ensure_sample_shards(out_root=None) -> tuple[str, str]:
    """Tokenize the shipped sample corpus (data/sample/*.jsonl.gz) once; return (train_glob, val_glob).

    The shards live in a folder named after the sample's hash, so an updated sample is re-tokenized, and the
    folder appears by one atomic rename, so ranks that call this at the same time never see half of it. By default
    that folder is data/sample/shards, or, in a checkout that cannot be written to (a read-only mount in a
    container), gpt-speedrun-sample in the system's temporary folder.
    """
    sources = sorted(SAMPLE_DIR.glob("*.jsonl.gz"))
    if not sources:
        raise PrepareError(f"the sample corpus (*.jsonl.gz) is missing from {SAMPLE_DIR}: restore it with "
                           f"`git checkout -- data/sample`")
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    if out_root is not None:
        root = Path(out_root)
    else:
        root = SAMPLE_DIR / "shards"
        if not (root / digest).is_dir() and not os.access(root if root.is_dir() else SAMPLE_DIR, os.W_OK):
            root = Path(tempfile.gettempdir()) / "gpt-speedrun-sample"
    final = root / digest
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            # In-process (workers=1): ~2 s for the sample, and no worker processes inside a training process.
            prepare(sources, staging / "shards", val_tokens=SAMPLE_VAL_TOKENS, name="sample", workers=1)
            os.rename(staging / "shards", final)
        except OSError:
            if not final.is_dir():  # it is there when another process won the race
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(final / "sample_train_*.bin"), str(final / "sample_val_*.bin")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories of .txt/.md/.jsonl(.gz)")
    parser.add_argument("--out", required=True, help="output directory for the .bin shards")
    parser.add_argument("--val_tokens", type=int, default=DEFAULT_VAL_TOKENS,
                        help="validation tokens (the val shard holds one more); default: the speedrun's")
    parser.add_argument("--shard_tokens", type=int, default=FINEWEB_SHARD_TOKENS, help="tokens per train shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    parser.add_argument("--name", default="corpus", help="shard file name prefix")
    args = parser.parse_args(argv)
    try:
        summary = prepare(args.inputs, args.out, val_tokens=args.val_tokens, shard_tokens=args.shard_tokens,
                          name=args.name, workers=args.workers)
    except PrepareError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    ignored = (f"; {summary['ignored_files']} of other types ignored, data.prepare reads .txt, .md and .jsonl"
               if summary["ignored_files"] else "")
    print(f"{summary['documents']:,} documents from {summary['files']} files ({summary['skipped_files']} skipped: "
          f"not UTF-8{ignored}): {summary['tokens']:,} tokens ({summary['val_tokens']:,} val, "
          f"{summary['train_tokens']:,} train) in {len(summary['shards'])} shards in {args.out}; "
          f"{summary['seconds']:.1f} s, {summary['tokens_per_second']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
