"""The .bin token shard format: one writer, one reader.

This is the format of llm.c and the Modded-NanoGPT speedrun, so their FineWeb shards load unchanged:
a header of HEADER_INTS little-endian int32 (`[0]` MAGIC, `[1]` VERSION, `[2]` token count, the rest zero)
followed by that many little-endian uint16 GPT-2 token ids. Every document starts with BOS_ID, so BOS_ID
marks document boundaries in the token stream.
"""
import os
import tempfile
from pathlib import Path

import numpy as np
from runtime.errors import UserError

MAGIC = 20240520  # llm.c's magic for GPT-2 token shards
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS_ID = 50256  # GPT-2's <|endoftext|>, written before every document
VOCAB_SIZE = 50257  # GPT-2 BPE: 50,000 merges + 256 bytes + <|endoftext|>
TOKEN_BYTES = 2  # uint16 ids
FINEWEB_SHARD_TOKENS = 100_000_000  # tokens in each train shard of the speedrun's FineWeb (the last one holds fewer)

_FIX_WRITE = ("was it written by `python -m data.prepare`? for FineWeb re-download with "
              "`python data/cached_fineweb10B.py N`")
_FIX_PARTIAL = ("the file is incomplete (interrupted download or write): delete it and re-download with "
                "`python data/cached_fineweb10B.py N` or re-create it with `python -m data.prepare`")


class ShardError(UserError):
    """A shard file that cannot be used; the message names the file, the problem and the fix."""


def write_shard(path, tokens) -> None:
    """Write `tokens` (1-D, ids in [0, 2**16)) as a shard; atomic, so a crash never leaves a partial file."""
    tokens = np.asarray(tokens)
    path = Path(path)
    if tokens.ndim != 1:
        raise ValueError(f"write_shard({path}): tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"write_shard({path}): token ids must lie in [0, 65536) to fit uint16, "
                         f"got range [{tokens.min()}, {tokens.max()}]")
    if tokens.size >= 2**31:
        raise ValueError(f"write_shard({path}): {tokens.size} tokens do not fit the int32 header count; "
                         "split them over several shards (data.prepare's --shard_tokens)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2", copy=False).tobytes())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; shards are data meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _unreadable(path: Path, error: PermissionError) -> ShardError:
    return ShardError(f"shard {path}: cannot be read ({error.strerror}): make it readable with `chmod a+r {path}`, "
                      f"or run as a user allowed to read it")


def read_header(path) -> int:
    """Return the token count of the shard at `path` after checking its header against its size."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"shard {path}: only {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                         f"{_FIX_PARTIAL}")
    try:
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except PermissionError as error:
        raise _unreadable(path, error) from None
    if header[0] != MAGIC:
        raise ShardError(f"shard {path}: magic number {header[0]}, expected {MAGIC}: this is not a token shard; "
                         f"{_FIX_WRITE}")
    if header[1] != VERSION:
        raise ShardError(f"shard {path}: format version {header[1]}, expected {VERSION}; {_FIX_WRITE}")
    count = int(header[2])
    payload = size - HEADER_BYTES
    if count < 0 or count * TOKEN_BYTES > payload:
        raise ShardError(f"shard {path}: header says {count} tokens ({count * TOKEN_BYTES} bytes) but only "
                         f"{payload} bytes follow the header; {_FIX_PARTIAL}")
    if count * TOKEN_BYTES < payload:
        raise ShardError(f"shard {path}: header says {count} tokens ({count * TOKEN_BYTES} bytes) but {payload} "
                         f"bytes follow the header; the file is corrupt or was appended to; {_FIX_WRITE}")
    return count


def read_shard(path) -> np.ndarray:
    """The shard's tokens as a read-only uint16 memmap (pages load lazily and are shared between processes)."""
    count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    try:
        return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    except PermissionError as error:  # its mode changed since read_header opened it
        raise _unreadable(Path(path), error) from None


def check_token_ids(tokens: np.ndarray, path, vocab_size: int = VOCAB_SIZE) -> None:
    """Raises ShardError if an id in `tokens` (of shard `path`) is not a GPT-2 id below `vocab_size`."""
    if tokens.size == 0:
        return
    top = int(tokens.max())
    if top >= VOCAB_SIZE:
        raise ShardError(f"shard {path}: holds token id {top}, but the GPT-2 vocabulary has {VOCAB_SIZE} ids: "
                         f"it was tokenized with another tokenizer; {_FIX_WRITE}")
    if top >= vocab_size:
        raise ShardError(f"shard {path}: holds token id {top}, but the model embeds only {vocab_size} ids: "
                         f"give the model a vocab_size of at least {VOCAB_SIZE}, GPT-2's vocabulary")


def check_shards(paths, vocab_size: int) -> int:
    """Checks every shard's header, then its token ids, so that a bad file fails at start-up; returns their total
    token count."""
    paths = list(dict.fromkeys(map(str, paths)))  # a shard given twice (train and val) is read once
    counts = [read_header(path) for path in paths]
    for path in paths:
        check_token_ids(read_shard(path), path, vocab_size)
    return sum(counts)
