"""Tokenize your own text into train/val shards.

    python -m data.prepare INPUT... --out DIR [--val_tokens N] [--shard_tokens N] [--workers N] [--name PREFIX]

INPUTs are files or directories (recursive, hidden entries skipped) of .txt / .md files (one document each),
.jsonl files (one document per line, its "text" field), optionally gzipped, and text files without an extension.
Each document is GPT-2 encoded after <|endoftext|>. The first val_tokens + 1 tokens (the + 1 is the input before
the first prediction) go to `<name>_val_000000.bin`, the rest to `<name>_train_000001.bin, ...` of shard_tokens
each, the FineWeb shards' layout. A directory's file that cannot be read is skipped with a warning naming it and
why; a named file that cannot be read, or a bad .jsonl line, is an error. Errors exit with status 2 and leave no
partial output.
"""
import argparse
import codecs
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shard import BOS_ID, FINEWEB_SHARD_TOKENS, write_shard
from data.tokenizer import get_encoding
from runtime.errors import UserError

TEXT_SUFFIXES, JSONL_SUFFIXES = (".txt", ".md"), (".jsonl",)
SNIFF_BYTES = 8192  # of a file without an extension, read to tell text from binary
READS = ".txt, .md and .jsonl files, optionally gzipped (.txt.gz, ...), and text files without an extension"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # a damaged header, a cut file, damaged data
DEFAULT_VAL_TOKENS = 10_485_760  # the speedrun's validation set size
BATCH_CHARS = 1 << 20  # text per worker task: hides IPC, balances the pool
SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE_VAL_TOKENS = 65_536  # a steady smoke-run validation loss, small next to the sample


class PrepareError(UserError):
    """A problem with the inputs or options of data.prepare; the message names the file or flag."""


def _unreadable(path: Path, error: OSError) -> tuple[str, str]:
    return "unreadable", f"cannot be read ({error.strerror}); make it readable with `chmod a+r {path}` to include it"


def _not_utf8(raw: bytes, error: UnicodeDecodeError) -> tuple[str, str]:
    source = "utf-16" if raw[:2] in UTF16_BOMS else "latin1"  # UTF-16 starts with a byte-order mark
    return "not UTF-8", (f"not UTF-8 text ({error.reason} at byte {error.start}); convert it to include it, e.g. "
                         f"`iconv -f {source} -t utf-8`")


def _open_text(path: Path):
    """The file's bytes, uncompressed if it is gzipped, as a binary stream."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _classify(path: Path) -> tuple[str | None, str, str]:
    """(kind, "", "") for a file data.prepare reads, kind "text" or "jsonl"; (None, category, why) for one it does
    not, `why` ending in the fix where there is one."""
    name = path.name.removesuffix(".gz")
    if name.endswith(TEXT_SUFFIXES):
        return "text", "", ""
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", "", ""
    if suffix := Path(name).suffix:
        extension = suffix + path.name[len(name):]  # with the .gz, if any
        return None, "unknown extension", f"unknown extension {extension}: data.prepare reads {READS}"
    try:
        with _open_text(path) as f:
            head = f.read(SNIFF_BYTES)
    except GZIP_ERRORS as error:
        return None, "binary", f"not a valid gzip file ({error})"
    except OSError as error:
        return (None, *_unreadable(path, error))
    if b"\0" in head and head[:2] not in UTF16_BOMS:
        return None, "binary", "binary, not text (it holds NUL bytes)"
    try:
        # a character cut at the end of the prefix is fine, at the end of the file it is not
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as error:
        return (None, *_not_utf8(head, error))
    return "text", "", ""


def input_files(inputs, skipped: list) -> list[tuple[Path, str]]:
    """The files to read with their kind ("text" or "jsonl"), in a fixed order, each once (else it could land in
    both splits). A directory's unread files go to `skipped` as (path, category, why); an unreadable named file is a
    PrepareError."""
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            visible = sorted(p for p in given.rglob("*") if p.is_file()
                             and not any(part.startswith(".") for part in p.relative_to(given).parts))
            for path in visible:
                kind, category, why = _classify(path)
                if kind:
                    files.append((path, kind))
                else:
                    skipped.append((path, category, why))
        elif given.is_file():
            kind, _, why = _classify(given)
            if not kind:
                raise PrepareError(f"{given}: {why}")
            try:  # named on purpose, so not to be passed over: checked now, before any output exists
                open(given, "rb").close()
            except OSError as error:
                raise PrepareError(f"{given}: {_unreadable(given, error)[1]}") from None
            files.append((given, kind))
        else:
            raise PrepareError(f"input {given} does not exist: pass existing files or directories")
    first = {}  # each file's first mention, in the order given
    for path, kind in files:
        first.setdefault(path.resolve(), (path, kind))
    once = list(first.values())
    if len(once) < len(files):
        print(f"warning: {len(files) - len(once)} file(s) given more than once (by name, or inside a folder also "
              f"given) are read once", file=sys.stderr)
    return once


def _read(path: Path) -> bytes:
    with _open_text(path) as f:
        try:
            return f.read()
        except GZIP_ERRORS as error:
            raise PrepareError(f"{path}: not a valid gzip file ({error}); fix or remove it") from None


def documents(files, skipped: list):
    """Yield the documents of `files` ((path, kind) pairs); the files skipped while reading (not UTF-8, unreadable)
    are appended to `skipped` as (path, category, why)."""
    for path, kind in files:
        try:
            raw = _read(path)
        except OSError as error:
            skipped.append((path, *_unreadable(path, error)))
            continue
        if kind == "text":
            try:
                text = raw.decode("utf-8-sig")  # a leading byte-order mark is no part of the text
            except UnicodeDecodeError as error:
                skipped.append((path, *_not_utf8(raw, error)))
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


def _no_documents(listed: int, skipped: list, named: int = 5) -> str:
    """What the files held, for the message that no documents were found: the skipped ones by name and why."""
    if not skipped:
        return f"{listed} file(s), all empty" if listed else "no files"
    names = "; ".join(f"{path}: {why}" for path, _, why in skipped[:named])
    more = f"; and {len(skipped) - named} more, named above" if len(skipped) > named else ""
    return f"{listed} file(s), {len(skipped)} skipped: {names}{more}"


def _skip_counts(skipped: list) -> str:
    """The summary's count of skipped files by category, e.g. `3 skipped: 1 binary, 2 unknown extension`."""
    counts = Counter(category for _, category, _ in skipped)
    if len(counts) == 1:
        return f"{len(skipped)} skipped: {next(iter(counts))}"
    return f"{len(skipped)} skipped: " + ", ".join(f"{n} {category}" for category, n in sorted(counts.items()))


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
    # spawn, not fork: a caller may hold threads that fork would copy mid-lock
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
    skipped = []
    files = input_files(inputs, skipped)
    listed = len(files) + len(skipped)
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
    doc_count = 0

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
        # the skipped files together, after the progress bar
        for path, _, why in skipped:
            print(f"warning: skipping {path}: {why}", file=sys.stderr)
        total = sum(writer.sizes) + writer.pending_len
        if doc_count == 0:
            raise PrepareError(f"no documents found in {', '.join(map(str, inputs))} ({_no_documents(listed, skipped)}"
                               f"): give .txt/.md/.jsonl files with text in them, or text files without an extension")
        if total <= val_tokens + 1:
            # the advice must pass this check itself: 1 <= --val_tokens <= total - 2
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
    return {"files": listed, "skipped": skipped, "documents": doc_count, "tokens": total,
            "val_tokens": writer.sizes[0], "train_tokens": total - writer.sizes[0], "shards": shards,
            "seconds": seconds, "tokens_per_second": total / seconds}


def ensure_sample_shards(out_root=None) -> tuple[str, str]:
    """Tokenizes the shipped sample corpus (data/sample/*.jsonl.gz) once; returns (train_glob, val_glob). The
    shards' folder is named after the sample's hash and appears by one atomic rename, so that concurrent ranks never
    see half of it; it lies in data/sample/shards, or in the temporary folder where the checkout is read-only."""
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
            # in-process: no worker processes inside a training process
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
    skipped = f" ({_skip_counts(summary['skipped'])})" if summary["skipped"] else ""  # each named in a warning
    print(f"{summary['documents']:,} documents from {summary['files']} files{skipped}: {summary['tokens']:,} tokens "
          f"({summary['val_tokens']:,} val, {summary['train_tokens']:,} train) in {len(summary['shards'])} shards in "
          f"{args.out}; {summary['seconds']:.1f} s, {summary['tokens_per_second']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
